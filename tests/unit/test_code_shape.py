"""The shape the package keeps (DESIGN.md): the rooms of train/ import only what their docstrings allow, and no
function grows past a screen."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "trainlift"
MAX_FUNCTION_LINES = 60


def imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return modules


def test_train_top_level_holds_only_the_driver_the_recipe_and_three_rooms():
    entries = {p.name for p in (SRC / "train").iterdir() if p.name != "__pycache__"}
    assert entries == {"__init__.py", "launch.py", "recipe.py", "data", "model", "run"}


def test_data_and_model_never_import_run_and_no_room_imports_the_cli():
    wrong = []
    for room, forbidden in (("data", ("trainlift.train.run", "trainlift.train.model", "trainlift.cli")),
                            ("model", ("trainlift.train.run", "trainlift.cli")), ("run", ("trainlift.cli",))):
        for path in (SRC / "train" / room).glob("*.py"):
            wrong += [f"{path.relative_to(SRC)} imports {m}" for m in imported_modules(path)
                      if m.startswith(forbidden)]
    assert wrong == []


def test_no_function_is_longer_than_a_screen():
    long = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []
