"""A broken rule as data: the field path it names, what is wrong, how to fix it; all of them as one SpecError."""

from __future__ import annotations

from dataclasses import dataclass

from trainlift.errors import SpecError


@dataclass(frozen=True)
class Problem:
    path: str
    message: str
    hint: str | None = None

    def line(self) -> str:
        return f"{self.path}: {self.message}"


def raise_problems(problems: list[Problem]) -> None:
    """One SpecError whose single line lists every problem, the first one's hint attached."""
    if problems:
        raise SpecError("; ".join(p.line() for p in problems), hint=problems[0].hint)
