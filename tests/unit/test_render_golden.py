"""Golden files for the reference deployment (examples/cluster-reference.yaml).

A reviewer diffs tests/golden/reference/ against the reference sample's manifests.
Regenerate after an intended change with:

    TRAINLIFT_UPDATE_GOLDEN=1 .venv/bin/pytest tests/unit/test_render_golden.py

which rewrites the files and fails (a rewrite compares them with themselves); review the diff, then rerun without
the variable.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainlift.config.cluster import cluster_spec_from_yaml
from trainlift.render import JobInputs, render_cluster

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "examples" / "cluster-reference.yaml"
GOLDEN = ROOT / "tests" / "golden" / "reference"
# The same deployment with `scheduler: none`: what render wrote before queueing was added (less the EFA variables
# aws-ofi-nccl calls obsolete).
GOLDEN_NO_SCHEDULER = ROOT / "tests" / "golden" / "reference-scheduler-none"
# The reference's job: Qwen2.5-1.5B on both nodes (world size 8), its code zipped on S3.
JOB = JobInputs(
    name="qwen2.5-1.5b-sft",
    spec_path="examples/qwen-sft.yaml",
    workers=8,
    working_dir="s3://my-trainlift-checkpoints/code/trainlift-job.zip",
    trainlift_uri="s3://my-trainlift-checkpoints/code/trainlift.zip",
    overrides=("run.storage=s3://my-trainlift-checkpoints/ray-train",),
)


def rendered(extra: str = "") -> dict[str, str]:
    spec = cluster_spec_from_yaml(SPEC.read_text() + extra, source=SPEC.name)
    return {m.path: m.text() for m in render_cluster(spec, JOB)}


def golden_files(golden: Path = GOLDEN) -> dict[str, str]:
    return {
        p.relative_to(golden).as_posix(): p.read_text()
        for p in sorted(golden.rglob("*.yaml"))
    }


@pytest.mark.parametrize("golden, extra", [(GOLDEN, ""), (GOLDEN_NO_SCHEDULER, "\nscheduler: none\n")],
                         ids=["default", "scheduler-none"])
def test_reference_deployment_matches_golden_files(golden, extra):
    actual = rendered(extra)
    if os.environ.get("TRAINLIFT_UPDATE_GOLDEN") == "1":
        for stale in set(golden_files(golden)) - set(actual):
            (golden / stale).unlink()
        for path, text in actual.items():
            target = golden / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        # A rewrite compares the files with themselves: it must never count as a pass.
        pytest.fail(f"golden files rewritten in {golden}; review the diff and rerun without TRAINLIFT_UPDATE_GOLDEN")
    expected = golden_files(golden)
    assert sorted(actual) == sorted(expected), "rendered files differ from the golden set (TRAINLIFT_UPDATE_GOLDEN=1)"
    for path in actual:
        assert actual[path] == expected[path], f"{path} differs from {golden.relative_to(ROOT)}/{path}"


def test_update_mode_rewrites_the_files_and_never_passes(tmp_path, monkeypatch):
    golden = tmp_path / "golden"
    (golden / "stale").mkdir(parents=True)
    (golden / "stale" / "gone.yaml").write_text("kind: Gone\n")
    monkeypatch.setenv("TRAINLIFT_UPDATE_GOLDEN", "1")
    with pytest.raises(pytest.fail.Exception, match="golden files rewritten"):
        test_reference_deployment_matches_golden_files(golden, "")
    assert golden_files(golden) == golden_files(GOLDEN) == rendered()


@pytest.mark.parametrize("path, needle", [
    ("k8s/20-raycluster.yaml", "mountPath: /dev/shm"),
    ("k8s/20-raycluster.yaml", "value: Libfabric"),
    ("k8s/20-raycluster.yaml", "vpc.amazonaws.com/efa: '1'"),
    ("k8s/20-raycluster.yaml", "serviceType: ClusterIP"),
    ("eksctl.yaml", "efaEnabled: true"),
    ("helm/aws-efa-k8s-device-plugin.values.yaml", "- g6.12xlarge"),
])
def test_golden_files_carry_the_improvements(path, needle):
    assert needle in (GOLDEN / path).read_text()
