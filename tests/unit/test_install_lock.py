"""`make` installs from a hashed lock: every dependency pyproject.toml declares (extras included) is pinned in
requirements.lock with sha256 hashes, torch alone left to its own pinned install, and this environment holds
exactly the locked releases (the suite tests what a fresh `make` installs)."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
ENTRY = re.compile(r"^([A-Za-z0-9_.-]+)==([^ ;\\]+)( ; [^\\]+)? \\$")


def locked() -> dict[str, tuple[str, str | None, list[str]]]:
    """name -> (version, marker, hashes) of every entry in requirements.lock."""
    entries, current = {}, None
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if found := ENTRY.match(line):
            current = canonicalize_name(found[1])
            entries[current] = (found[2], found[3][3:] if found[3] else None, [])
        elif line.strip().startswith("--hash=sha256:"):
            entries[current][2].append(line.strip().removeprefix("--hash=sha256:").rstrip(" \\"))
    return entries


def test_every_declared_dependency_is_locked_with_hashes_and_torch_is_not():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
    lock = locked()
    for text in declared:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if name == "torch":
            assert name not in lock  # installed by `pip install torch==…`: a CPU or a CUDA build
            continue
        assert name in lock, f"{req.name} is not in requirements.lock: run `make lock`"
        assert req.specifier.contains(lock[name][0], prereleases=True), f"{req.name}=={lock[name][0]} vs {text}"
    assert all(len(h) == 64 for _, _, hashes in lock.values() for h in hashes)
    assert all(hashes for _, _, hashes in lock.values())
    assert not [n for n in lock if n.startswith(("nvidia-", "cuda-")) or n == "triton"]
    make = (ROOT / "Makefile").read_text()
    assert "--require-hashes --no-deps -r requirements.lock" in make and "pip install --quiet --upgrade pip" not in make


def test_this_environment_holds_the_locked_releases():
    lock = locked()
    wrong = {}
    for name, (version, marker, _) in lock.items():
        if marker and not Marker(marker).evaluate():
            continue
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = None
        if installed != version:
            wrong[name] = (installed, version)
    assert wrong == {}, "installed vs locked; rerun `make` (the venv is older than requirements.lock)"
