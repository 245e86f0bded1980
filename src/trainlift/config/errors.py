"""One line for the first problem pydantic found in a spec, starting with its field path (`workers[0].gpus`)."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError


def field_path(parts: tuple[Any, ...]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def first_error(exc: ValidationError) -> str:
    errors = exc.errors()
    err = errors[0]
    loc = field_path(err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    elif err["type"] == "missing":
        msg = "required key is missing"
    elif "input" in err and not isinstance(err["input"], dict) and "(got " not in msg:
        msg = f"{msg} (got {err['input']!r})"
    line = f"{loc}: {msg}" if loc else msg
    return line + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else "")
