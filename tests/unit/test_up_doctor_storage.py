"""`cluster up`'s doctor step probes the run storage with the pods' own role when the cluster keeps it on S3
(doctor/storage.py: HeadBucket, put, get and delete under the prefix), and passes that flag to the real CLI."""

from __future__ import annotations

from pathlib import Path

import yaml
from typer.testing import CliRunner

from trainlift.cli import app
from trainlift.config.cluster import cluster_spec_from_yaml
from trainlift.ops.placement import Placement
from trainlift.ops.plan import Files, Observed, plan_up

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = yaml.safe_load((ROOT / "examples" / "cluster-reference.yaml").read_text())
PLACED = {"gpu-workers": Placement("gpu-workers", "us-east-2a", "pinned in the spec; offered there")}


def _doctor_argv(data: dict) -> tuple[str, ...]:
    spec = cluster_spec_from_yaml(yaml.safe_dump(data))
    step = next(s for s in plan_up(spec, Observed.nothing(), PLACED, Files(".trainlift/x")).steps if s.key == "doctor")
    return step.ops[0].argv


def test_s3_storage_is_probed_on_every_node():
    argv = _doctor_argv(REFERENCE)
    assert argv[argv.index("--storage") + 1] == "s3://my-trainlift-checkpoints/ray-train"
    # The argv runs as `python -m trainlift <argv[1:]>` (ops/apply_plan.py): the CLI accepts it as it stands.
    parsed = CliRunner().invoke(app, [*argv[1:], "--help"])
    assert parsed.exit_code == 0, parsed.output


def test_fsx_storage_is_not_probed_as_s3():
    data = yaml.safe_load(yaml.safe_dump(REFERENCE))
    data["storage"] = {"fsx": {"claim": "fsx-claim"}}
    assert "--storage" not in _doctor_argv(data)
