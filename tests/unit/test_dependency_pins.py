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


def test_every_floor_admits_what_the_cluster_image_carries():
    """The code that runs on a node runs on the image's packages: no declared range may exclude them (transformers'
    floor once said 4.53.1 while the code needs 5.x's loading modules; the image has 5.13)."""
    from trainlift.catalog.packages import image_lock, normalize

    lock = image_lock("public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.1.0")
    checked = []
    for name, req in requirements().items():
        if (have := lock.packages.get(normalize(name))) is not None:
            assert req.specifier.contains(have.split("+")[0], prereleases=True), (name, str(req.specifier), have)
            checked.append(name)
    assert {"ray", "torch", "transformers", "pydantic", "typer", "pyarrow"} <= set(checked)
    assert not requirements()["transformers"].specifier.contains("4.57.0")
