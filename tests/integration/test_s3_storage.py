"""Checkpoints, metrics, summary and export on S3: a real S3-compatible server (moto, over HTTP on loopback)."""

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import boto3
import pytest
import yaml

h = runpy.run_path(str(Path(__file__).with_name("conftest_aws.py")))["load"]()  # the session's moto server
pytestmark = pytest.mark.slow


@pytest.fixture
def s3_env(monkeypatch, tmp_path):
    env = h.use(monkeypatch, tmp_path)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    boto3.client("s3").create_bucket(Bucket="trainlift-ckpts")
    return env


def train(job, *args):
    env = {**os.environ, "RAY_ADDRESS": "", "TRAINLIFT_HOME": str(job.parent / "home")}
    return subprocess.run([sys.executable, "-m", "trainlift", "train", str(job), *args, "--json"], env=env,
                          capture_output=True, text=True, timeout=400)


def test_run_on_s3_checkpoints_resumes_and_exports(s3_env, tiny_assets, tmp_path):
    spec = {"model": {"path": str(tiny_assets / "model")},
            "data": {"train": str(tiny_assets / "train.jsonl"), "seq_len": 64},
            "train": {"steps": 4, "micro_batch_size": 2, "warmup_steps": 1},
            "checkpoint": {"every_steps": 2, "keep": 1}, "run": {"name": "s3run", "storage": "s3://trainlift-ckpts/runs"}}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))

    first = train(job, "--stop-at-step", "2")
    assert first.returncode == 3, first.stderr[-2000:]
    second = train(job)
    assert second.returncode == 0, second.stderr[-2000:]
    assert json.loads(second.stdout)["resumed_from"].endswith("checkpoint_00000002")

    keys = {o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket="trainlift-ckpts", Prefix="runs/s3run/")["Contents"]}
    assert "runs/s3run/checkpoint_00000004/COMPLETE" in keys
    assert not any(k.startswith("runs/s3run/checkpoint_00000002/") for k in keys)  # pruned, keep=1
    assert {"runs/s3run/metrics.jsonl", "runs/s3run/summary.json", "runs/s3run/final/config.json"} <= keys
    body = boto3.client("s3").get_object(Bucket="trainlift-ckpts", Key="runs/s3run/metrics.jsonl")["Body"].read()
    steps = [json.loads(line)["step"] for line in body.decode().splitlines() if "loss" in json.loads(line)]
    assert steps == [1, 2, 3, 4]


def test_missing_bucket_is_one_line_and_exit_2(s3_env, tiny_assets, tmp_path):
    spec = {"model": {"path": str(tiny_assets / "model")}, "data": {"train": str(tiny_assets / "train.jsonl"),
            "seq_len": 64}, "run": {"storage": "s3://no-such-bucket/runs"}}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    result = train(job)
    assert result.returncode == 2 and "bucket of s3://no-such-bucket/runs/run does not exist" in result.stderr
    assert "Traceback" not in result.stderr
