"""The documentation a user reads: README.md and every docs/*.md page.

Tests that check what the documentation says (every spec key documented, the torch floor stated, the example
pairs named, the commands runnable) read it through here, whichever page a fact lives on. Loaded by path
(`runpy.run_path`), as the tests run with `--import-mode=importlib`.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def doc_files() -> list[Path]:
    """README.md, then docs/*.md in name order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def docs_text() -> str:
    """The text of README.md and every docs page, one after the other."""
    return "\n".join(path.read_text(encoding="utf-8") for path in doc_files())
