"""The declared dependency ranges admit what the suite runs on and nothing it has not seen."""

from __future__ import annotations

import tomllib
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def requirements() -> dict[str, Requirement]:
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    return {req.name: req for req in map(Requirement, deps)}


def test_the_installed_ray_and_transformers_are_inside_the_declared_ranges():
    reqs = requirements()
    for name in ("ray", "transformers", "torch"):
        assert reqs[name].specifier.contains(version(name), prereleases=True), (name, version(name))


def test_ray_stops_below_the_next_untested_minor():
    """Ray Train's API changes between minors: a fresh install must not pick one nobody has run."""
    tested = Version(version("ray"))
    assert not requirements()["ray"].specifier.contains(f"{tested.major}.{tested.minor + 1}.0")


def test_transformers_floor_masks_packed_examples_apart():
    """Packed rows rely on transformers masking attention by restarting position ids (masking_utils,
    find_packed_sequence_indices), first released in 4.53.1; 4.53.0 and older let packed examples attend to
    each other."""
    spec = requirements()["transformers"].specifier
    assert not spec.contains("4.53.0") and spec.contains("4.53.1")
