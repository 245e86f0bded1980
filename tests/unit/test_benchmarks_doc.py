"""docs/BENCHMARKS.md holds one section per benchmark, and the benchmark scripts rewrite their own section in
place (between `<!-- bench:KEY -->` markers) instead of appending another copy of it."""

from __future__ import annotations

import importlib.util
import re
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "BENCHMARKS.md"
MARKER = re.compile(r"<!-- (/?)bench:([a-z0-9_]+) -->")  # `<!-- bench:KEY -->` in prose is no marker


def benchlib():
    spec = importlib.util.spec_from_file_location("benchlib_under_test", REPO / "bench" / "benchlib.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def headings(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("## ")]


def marked_sections(text: str) -> dict[str, str]:
    """KEY -> what lies between its markers; fails on a marker without its pair, nested or repeated pairs."""
    sections: dict[str, str] = {}
    open_key, open_end = None, 0
    for m in MARKER.finditer(text):
        closing, key = m.group(1) == "/", m.group(2)
        assert text[m.start() - 1:m.start()] in ("", "\n") and text[m.end():m.end() + 1] == "\n", \
            f"marker {m.group(0)} is not on a line of its own"
        if not closing:
            assert open_key is None, f"{key} opens inside {open_key}"
            assert key not in sections, f"{key} has two sections"
            open_key, open_end = key, m.end()
        else:
            assert open_key == key, f"{m.group(0)} closes {open_key or 'nothing'}"
            sections[key], open_key = text[open_end:m.start()], None
    assert open_key is None, f"{open_key} is never closed"
    return sections


def test_every_heading_in_the_benchmarks_doc_is_unique():
    repeated = [h for h, n in Counter(headings(DOC.read_text(encoding="utf-8"))).items() if n > 1]
    assert repeated == []


def test_every_marker_pair_is_well_formed_and_holds_one_section():
    sections = marked_sections(DOC.read_text(encoding="utf-8"))
    assert sections
    for key, inner in sections.items():
        assert inner.startswith("\n## "), f"{key}: a section starts with its heading"
        assert len(headings(inner)) == 1, f"{key}: one heading per section"
        assert "- Command: `python bench/" in inner and "- Date: " in inner, f"{key}: command and date"


def test_every_section_in_the_doc_belongs_to_a_script():
    used = set()
    for script in (REPO / "bench").glob("*.py"):
        source = script.read_text(encoding="utf-8")
        used |= set(re.findall(r'key="([a-z0-9_]+)"', source))
        used |= {f"{prefix}{what}" for prefix in re.findall(r'key=f"([a-z0-9_]+)\{what\}"', source)
                 for what in ("load", "export", "loss")}
    assert set(marked_sections(DOC.read_text(encoding="utf-8"))) <= used


SMALL_DOC = """# Benchmarks

Intro text.

<!-- bench:alpha -->
## 1. Alpha

- Command: `python bench/alpha.py`

old alpha figure
<!-- /bench:alpha -->

Notes kept by hand.

<!-- bench:beta -->
## 2. Beta

beta figure, untouched
<!-- /bench:beta -->
"""


@pytest.fixture()
def bl(monkeypatch):
    module = benchlib()
    monkeypatch.setattr(module, "machine_line", lambda: "test machine")
    monkeypatch.setattr(module, "command_line", lambda: "python bench/alpha.py --pairs 1")
    monkeypatch.setitem(module.QUIET, "record", True)
    return module


def test_recording_replaces_its_section_in_place_and_leaves_the_rest_byte_for_byte(bl, tmp_path):
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text(SMALL_DOC, encoding="utf-8")
    before, after = SMALL_DOC.split("<!-- bench:alpha -->")[0], SMALL_DOC.split("<!-- /bench:alpha -->")[1]

    bl.record("1. Alpha", [(0.5, 0.4, 0.3)], "new alpha figure", key="alpha", path=doc)
    once = doc.read_text(encoding="utf-8")
    bl.record("1. Alpha", [(0.5, 0.4, 0.3)], "newer alpha figure", key="alpha", path=doc)
    twice = doc.read_text(encoding="utf-8")

    for text, figure in ((once, "new alpha figure"), (twice, "newer alpha figure")):
        assert text.startswith(before + "<!-- bench:alpha -->\n## 1. Alpha\n")
        assert text.endswith("<!-- /bench:alpha -->" + after)
        assert marked_sections(text)["alpha"].endswith(f"\n{figure}\n")
        assert "old alpha figure" not in text
        assert headings(text) == ["## 1. Alpha", "## 2. Beta"]
    assert "- Command: `python bench/alpha.py --pairs 1`\n- Machine: test machine\n" in twice
    assert "new alpha figure" not in twice
    assert bl.replace_section(twice, "alpha", marked_sections(twice)["alpha"]) == twice


def test_recording_appends_a_marked_section_when_its_markers_are_missing(bl, tmp_path):
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text(SMALL_DOC, encoding="utf-8")

    bl.record("3. Gamma", [], "gamma figure", key="gamma", path=doc)
    text = doc.read_text(encoding="utf-8")

    assert text.startswith(SMALL_DOC)
    assert text[len(SMALL_DOC):].startswith("\n<!-- bench:gamma -->\n## 3. Gamma\n")
    assert text.endswith("gamma figure\n<!-- /bench:gamma -->\n")
    assert list(marked_sections(text)) == ["alpha", "beta", "gamma"]


def test_recording_refuses_to_guess(bl, tmp_path):
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text(SMALL_DOC + "\n## 1. Alpha\n\nan unmarked copy\n", encoding="utf-8")
    with pytest.raises(ValueError, match="1. Alpha"):  # its markers replaced, the old copy would still be there
        bl.record("1. Alpha", [], "figure", key="alpha", path=doc)
    assert doc.read_text(encoding="utf-8") == SMALL_DOC + "\n## 1. Alpha\n\nan unmarked copy\n"
    doc.write_text(SMALL_DOC.replace("<!-- /bench:alpha -->\n", ""), encoding="utf-8")
    with pytest.raises(ValueError, match="alpha"):
        bl.record("1. Alpha", [], "figure", key="alpha", path=doc)
    assert doc.read_text(encoding="utf-8") == SMALL_DOC.replace("<!-- /bench:alpha -->\n", "")


def test_no_record_leaves_the_file_alone(bl, tmp_path):
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text(SMALL_DOC, encoding="utf-8")
    bl.QUIET["record"] = False
    bl.record("1. Alpha", [], "figure", key="alpha", path=doc)
    assert doc.read_text(encoding="utf-8") == SMALL_DOC
