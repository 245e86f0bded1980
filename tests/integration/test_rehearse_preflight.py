"""`trainlift rehearse` refuses, in one line and before any Ray process starts, a render whose S3 side cannot work:
no credentials, no reachable endpoint, a bucket or a runtime_env object that is not there. S3 is a real
S3-compatible server (moto, over HTTP); nothing is uploaded but what a case needs."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest
import yaml

h = runpy.run_path(str(Path(__file__).with_name("conftest_aws.py")))["load"]()  # the session's moto server
REPO = Path(__file__).resolve().parents[2]
BUCKET = "my-trainlift-checkpoints"  # the reference cluster spec's bucket
JOB_ZIP, WHEEL = f"s3://{BUCKET}/code/job.zip", f"s3://{BUCKET}/code/trainlift-0.1.0-py3-none-any.whl"
TRAINLIFT = os.path.join(os.path.dirname(sys.executable), "trainlift")


def cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "RAY_ADDRESS": "", "AWS_REGION": "us-east-2"} if env is None else env
    start = time.monotonic()
    done = subprocess.run([TRAINLIFT, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=60)
    return done, time.monotonic() - start


@pytest.fixture(scope="module")
def render(tmp_path_factory) -> Path:
    """The reference cluster rendered with a job whose code and trainlift are on S3 (not uploaded)."""
    root = tmp_path_factory.mktemp("project")
    (root / "job.yaml").write_text(yaml.safe_dump({
        "model": {"path": "model"}, "data": {"train": "train.jsonl", "seq_len": 64}, "train": {"steps": 4},
        "run": {"name": "rehearsed", "storage": "runs"}}))
    rendered, _ = cli("render", str(REPO / "examples" / "cluster-reference.yaml"), "--job", "job.yaml",
                      "--working-dir", JOB_ZIP, "--trainlift-uri", WHEEL, "-o", str(root / "out"), cwd=root)
    assert rendered.returncode == 0, rendered.stderr
    return root


def refused_in_one_line(result: subprocess.CompletedProcess, elapsed: float, *named: str) -> None:
    """Exit 2, one stderr line naming `named`, no output, no traceback, in seconds: no Ray process was started (in
    the table mode, starting one would have said so on stderr first)."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and result.stdout == "", result.stderr[-2000:]
    assert "Traceback" not in result.stderr and all(n in lines[0] for n in named), lines[0]
    assert elapsed < 30


@pytest.mark.parametrize("uploaded, named", [
    ((), ["the bucket of s3://my-trainlift-checkpoints/code/job.zip does not exist", "aws s3 mb"]),
    (("bucket",), ["runtime_env.working_dir: s3://my-trainlift-checkpoints/code/job.zip does not exist",
                   "aws s3 cp"]),
    (("bucket", "code/job.zip"), [f"runtime_env.py_modules: {WHEEL} does not exist", "trainlift package --upload"]),
])
@pytest.mark.parametrize("json_out", [True, False])
def test_what_is_not_on_s3_is_one_line_before_ray_starts(render, monkeypatch, tmp_path, uploaded, named, json_out):
    h.use(monkeypatch, tmp_path)
    s3 = boto3.client("s3", region_name="us-east-2")
    if "bucket" in uploaded:
        s3.create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": "us-east-2"})
    for key in uploaded[1:]:
        s3.put_object(Bucket=BUCKET, Key=key, Body=b"PK\x05\x06" + bytes(18))  # an empty zip
    result, elapsed = cli("rehearse", "out", *(["--json"] if json_out else []), cwd=render)
    refused_in_one_line(result, elapsed, *named)


def test_no_credentials_and_no_endpoint_are_one_line_each(render, tmp_path):
    bare = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    bare.update(RAY_ADDRESS="", HOME=str(tmp_path), AWS_ENDPOINT_URL="http://127.0.0.1:9")  # no ~/.aws; port closed
    result, elapsed = cli("rehearse", "out", env=bare, cwd=render)
    refused_in_one_line(result, elapsed, f"no AWS credentials: the rehearsal reads {JOB_ZIP}", "moto_server")
    keys = {**bare, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-2"}
    result, elapsed = cli("rehearse", "out", "--json", env=keys, cwd=render)
    refused_in_one_line(result, elapsed, f"cannot reach S3 at http://127.0.0.1:9 to read {JOB_ZIP}")
