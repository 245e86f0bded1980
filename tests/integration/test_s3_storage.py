"""run.storage on S3 checked before training: a real S3-compatible server (moto, over HTTP on loopback). A whole run
on S3, with its faults, is in test_storage_faults.py."""

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

h = runpy.run_path(str(Path(__file__).with_name("conftest_aws.py")))["load"]()  # the session's moto server
pytestmark = pytest.mark.slow


@pytest.fixture
def s3_env(monkeypatch, tmp_path):
    return h.use_bucket(monkeypatch, tmp_path, "trainlift-ckpts")


def train(job, *args):
    env = {**os.environ, "RAY_ADDRESS": "", "TRAINLIFT_HOME": str(job.parent / "home")}
    return subprocess.run([sys.executable, "-m", "trainlift", "train", str(job), *args, "--json"], env=env,
                          capture_output=True, text=True, timeout=400)


def test_missing_bucket_is_one_line_and_exit_2(s3_env, tiny_assets, tmp_path):
    spec = {"model": {"path": str(tiny_assets / "model")}, "data": {"train": str(tiny_assets / "train.jsonl"),
            "seq_len": 64}, "run": {"storage": "s3://no-such-bucket/runs"}}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    result = train(job)
    assert result.returncode == 2 and "bucket of s3://no-such-bucket/runs/run does not exist" in result.stderr
    assert "Traceback" not in result.stderr
