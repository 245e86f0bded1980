"""TensorBoard, the report and the runs listing with the run on S3: a moto server over HTTP, no Ray (the
tracker is fed the rows a run's rank 0 writes; tests/integration/test_observability.py trains for real)."""

import json
import runpy
import time
from pathlib import Path

import boto3
import pyarrow.fs as pafs
import pytest

from trainlift.config.job import validate_job_spec
from trainlift.train.run import trackers

h = runpy.run_path(str(Path(__file__).with_name("conftest_aws.py")))["load"]()  # the session's moto server
BUCKET = "trainlift-observe"


@pytest.fixture
def s3_run(monkeypatch, tmp_path):
    h.use(monkeypatch, tmp_path)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    boto3.client("s3").create_bucket(Bucket=BUCKET)
    spec = validate_job_spec({"model": {"path": "m"}, "data": {"train": "t.jsonl"},
                              "run": {"name": "s3run", "storage": f"s3://{BUCKET}/runs", "trackers": ["tensorboard"]}})
    fs, run_path = pafs.FileSystem.from_uri(spec.run_uri)
    sink = trackers.open_sink(spec, fs, run_path, 0)
    sink.write({"event": "start", "step": 0, "total_steps": 3, "world": 2, "resumed_from": None, "time": time.time()})
    for step in (1, 2, 3):
        sink.write({"step": step, "loss": 3.0 - step / 2, "lr": 1e-3, "grad_norm": 1.0, "world": 2, "tokens": 64,
                    "tokens_per_s": 640.0, "step_time_s": 0.1, "mfu": None, "time": time.time()})
        if step == 2:
            sink.flush()  # a checkpoint boundary
    sink.write({"step": 3, "eval_loss": 1.9, "time": time.time()})
    sink.close({"finished": True, "steps": 3})
    with fs.open_output_stream(f"{run_path}/summary.json") as out:
        out.write(json.dumps({"finished": True, "steps": 3, "final_loss": 1.5}).encode())
    return spec


def test_tensorboard_event_files_are_uploaded_to_the_run_on_s3(s3_run, tmp_path):
    from tensorboard.backend.event_processing import event_accumulator

    s3 = boto3.client("s3")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="runs/s3run/tensorboard/")["Contents"]]
    assert keys and all(Path(k).name.startswith("events.out.tfevents.") for k in keys)
    local = tmp_path / "tb"
    local.mkdir()
    for key in keys:
        s3.download_file(BUCKET, key, str(local / Path(key).name))
    acc = event_accumulator.EventAccumulator(str(local))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3] and [e.step for e in acc.Scalars("eval/loss")] == [3]


def test_report_and_runs_read_the_run_from_s3(s3_run, tmp_path):
    from typer.testing import CliRunner

    from trainlift.cli import app

    listed = CliRunner().invoke(app, ["runs", f"s3://{BUCKET}/runs", "--json"])
    assert listed.exit_code == 0, listed.output
    row, = json.loads(listed.stdout)
    assert (row["name"], row["steps"], row["total_steps"], row["loss"], row["eval_loss"], row["state"]) == (
        "s3run", 3, 3, 1.5, 1.9, "finished")
    result = CliRunner().invoke(app, ["report", s3_run.run_uri, "-o", str(tmp_path / "r.html"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["plots"] == ["loss", "lr", "tokens_per_s"]
    assert "<th>final_loss</th><td>1.5000</td>" in (tmp_path / "r.html").read_text()
