"""Kueue's waitForPodsReady and `cluster up`'s waits come from the image's modelled first pull on each node group
(render/cold_start.py, estimate/timing.py `image_pull_s`), with headroom, not from constants; render prints them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from trainlift import catalog
from trainlift.catalog.lookup import load_data
from trainlift.cli import app
from trainlift.config.cluster import cluster_spec_from_yaml
from trainlift.estimate import assumptions
from trainlift.estimate.timing import image_pull_s
from trainlift.ops.placement import Placement
from trainlift.ops.plan import Files, Observed, plan_up
from trainlift.render import render_cluster
from trainlift.render.cold_start import cold_start, pull_path

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = (ROOT / "examples" / "cluster-reference.yaml").read_text()
PLACED = {"gpu-workers": Placement("gpu-workers", "us-east-2a", "pinned in the spec; offered there")}
BIG, SMALL = "registry.example.com/team/ray-big:1", "registry.example.com/team/ray-small:1"


@pytest.fixture
def sized_images(monkeypatch):
    """Two images the catalog sizes: 25 GB (a DLC-sized image) and 2 GB."""
    images = catalog.platform()["images"]
    monkeypatch.setitem(images, BIG, {"ray_version": "2.58.0", "size_gb": 25})
    monkeypatch.setitem(images, SMALL, {"ray_version": "2.58.0", "size_gb": 2})


def _spec(image: str):
    return cluster_spec_from_yaml(REFERENCE.replace(
        "  uri: public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1", f"  uri: {image}\n  ray_version: 2.58.0"))


def _waits(image: str) -> dict[str, int]:
    """Every wait the rendered cluster and `cluster up`'s plan carry, in seconds."""
    spec = _spec(image)
    kueue = next(m for m in render_cluster(spec) if m.path == "helm/kueue.values.yaml")
    ready = yaml.safe_load(kueue.body["managerConfig"]["controllerManagerConfigYaml"])["waitForPodsReady"]
    plan = plan_up(spec, Observed.nothing(), PLACED, Files(".trainlift/ray-train"))
    ops = {s.key: s.ops[0] for s in plan.steps if s.key in ("wait/head", "wait/workers")}
    assert f"--timeout={ops['wait/head'].timeout_s}s" in ops["wait/head"].argv  # the command shown waits as long
    return {"kueue": int(ready["timeout"].removesuffix("m")) * 60, "head": ops["wait/head"].timeout_s,
            "workers": ops["wait/workers"].timeout_s}


def test_a_25_gb_image_on_m7i_xlarge_gets_waits_longer_than_its_modelled_pull(sized_images):
    spec = _spec(BIG)
    pull = image_pull_s(25, pull_path(spec, "m7i.xlarge"))
    assert 360 < pull < 400  # 25 GB at the published pull's 17.6 GB in 266 s
    headroom = load_data("scheduling.yaml")["pods_ready"]["headroom"]
    waits = _waits(BIG)
    # Longer than the pull with its headroom, not merely longer than the pull: a pull 2x slower still fits.
    assert all(w >= headroom * pull for w in waits.values()), waits
    assert waits["head"] == cold_start(spec).head_wait_s == 996  # 2 x 378 s + 240 s for Ray's start
    assert waits["kueue"] == 17 * 60


def test_a_small_image_gets_shorter_waits_than_a_large_one(sized_images):
    small, big = _waits(SMALL), _waits(BIG)
    assert all(small[k] < big[k] for k in big), (small, big)
    assert small["head"] == 301  # 2 GB pulls in 30 s: twice that and Ray's 240 s


def test_the_model_reproduces_estimates_cold_start_for_the_dlc():
    """`estimate` charges the field report's pull of the Ray Train DLC; the waits' model gives the same at the DLC's
    catalogued size, so both use one model."""
    spec = cluster_spec_from_yaml(REFERENCE)
    modelled = cold_start(spec)
    assert modelled.size_known and modelled.image.endswith(":train-ml-cuda-v1.1.0")
    charged = assumptions.figure("cold_start", "image_pull_s").value
    for group in (modelled.head, *modelled.workers):
        assert abs(group.seconds - charged) / charged < 0.05, (group, charged)


def test_an_image_the_catalog_does_not_size_is_taken_as_the_dlc():
    start = cold_start(_spec("registry.example.com/team/unknown:1"))
    assert not start.size_known and start.image_gb == catalog.platform()["defaults"]["image_size_gb"]
    assert "not in the catalog" in start.lines()[0]


def test_render_prints_the_waits(tmp_path):
    result = CliRunner().invoke(app, ["render", str(ROOT / "examples" / "cluster-reference.yaml"), "--check"])
    assert result.exit_code == 0, result.output
    waits = [line for line in result.stdout.splitlines() if line.startswith("wait   ")]
    assert waits == [
        "wait   image public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.1.0, 24 GB: first pull modelled "
        "at 6m03s on m7i.xlarge (system-nodes), 6m03s on g6.12xlarge (gpu-workers)",
        "wait   cluster up waits 16m06s for the head, 16m06s for the workers; Kueue waitForPodsReady 17m (2x the "
        "pull + 4m00s for Ray's start)"], result.stdout
