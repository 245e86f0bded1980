"""`trainlift rehearse` on the reference cluster's render: a real local Ray head and two raylets shaped like its
RayCluster, the RayJob submitted through a real dashboard's Jobs API, code, trainlift and checkpoints on a real
S3-compatible server (moto, over HTTP). What only EKS can show (EFA, GPUs, the image itself) is not tested here."""

from __future__ import annotations

import json
import os
import runpy
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import boto3
import pytest
import yaml

h = runpy.run_path(str(Path(__file__).with_name("conftest_aws.py")))["load"]()  # the session's moto server
REPO = Path(__file__).resolve().parents[2]
BUCKET = "my-trainlift-checkpoints"  # the reference cluster spec's bucket
TRAINLIFT = os.path.join(os.path.dirname(sys.executable), "trainlift")


def cli(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_ADDRESS": "", "AWS_REGION": "us-east-2"}
    return subprocess.run([TRAINLIFT, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def zip_dir(source: Path, target: Path, inside: str = "") -> None:
    with zipfile.ZipFile(target, "w") as z:
        for path in sorted(source.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                z.write(path, f"{inside}{path.relative_to(source)}")


@pytest.fixture
def project(monkeypatch, tmp_path, tiny_assets):
    """A project (tiny model, data, job spec) zipped to S3 with trainlift's wheel, as README's EKS section says."""
    h.use(monkeypatch, tmp_path)
    s3 = boto3.client("s3", region_name="us-east-2")
    s3.create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": "us-east-2"})
    root = tmp_path / "project"
    shutil.copytree(tiny_assets / "model", root / "model")
    shutil.copy(tiny_assets / "train.jsonl", root / "train.jsonl")
    (root / "job.yaml").write_text(yaml.safe_dump({
        "model": {"path": "model"}, "data": {"train": "train.jsonl", "seq_len": 64},
        "train": {"steps": 4, "micro_batch_size": 2, "warmup_steps": 1}, "checkpoint": {"every_steps": 2},
        "run": {"name": "rehearsed", "storage": "runs"}}))
    zip_dir(root, tmp_path / "job.zip")
    s3.upload_file(str(tmp_path / "job.zip"), BUCKET, "code/job.zip")
    packaged = cli("package", "-o", str(tmp_path / "dist"), "--upload", f"s3://{BUCKET}/code/", "--json", cwd=root)
    assert packaged.returncode == 0, packaged.stderr
    return root, s3, json.loads(packaged.stdout)["uri"]


def render(root: Path, out: Path, trainlift_uri: str) -> None:
    rendered = cli("render", str(REPO / "examples" / "cluster-reference.yaml"), "--job", "job.yaml", "--working-dir",
                   f"s3://{BUCKET}/code/job.zip", "--trainlift-uri", trainlift_uri, "-o", str(out), cwd=root)
    assert rendered.returncode == 0, rendered.stderr


def test_the_rendered_job_runs_with_its_code_trainlift_and_checkpoints_on_s3(project, tmp_path):
    root, s3, wheel_uri = project
    render(root, tmp_path / "out", wheel_uri)
    result = cli("rehearse", str(tmp_path / "out"), "--json", cwd=root)
    assert result.stdout, result.stderr[-3000:]
    outcome = json.loads(result.stdout)
    assert result.returncode == 0 and outcome["ok"] and outcome["status"] == "SUCCEEDED", "\n".join(
        f"{c['state']}: {c['evidence']}" for c in outcome["checks"])
    assert len(outcome["checks"]) == 4 and "EFA and the NCCL transport" in outcome["not_proven"]
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="ray-train/rehearsed/")["Contents"]}
    assert "ray-train/rehearsed/summary.json" in keys and any("/checkpoint_00000004/" in k for k in keys)


def test_a_trainlift_zip_of_the_old_layout_fails_and_says_why(project, tmp_path):
    """`cd src && zip -r trainlift.zip trainlift` (the layout README once gave): Ray unpacks the folder's contents,
    so the image could not import trainlift. This machine can (its own install): the rehearsal names that."""
    root, s3, _ = project
    zip_dir(REPO / "src" / "trainlift", tmp_path / "trainlift.zip", inside="trainlift/")
    s3.upload_file(str(tmp_path / "trainlift.zip"), BUCKET, "code/trainlift.zip")
    render(root, tmp_path / "out", f"s3://{BUCKET}/code/trainlift.zip")
    result = cli("rehearse", str(tmp_path / "out"), "--json", cwd=root)
    outcome = json.loads(result.stdout)
    assert result.returncode == 1 and outcome["status"] == "FAILED"
    failed = [c for c in outcome["checks"] if c["state"] == "failed"]
    assert "not from py_modules" in failed[0]["evidence"] and "trainlift package" in failed[0]["evidence"]


def test_a_render_whose_uris_the_role_does_not_cover_fails_before_anything_starts(project, tmp_path):
    root, _, wheel_uri = project
    render(root, tmp_path / "out", wheel_uri)
    rayjob = tmp_path / "out" / "k8s" / "30-rayjob.yaml"
    body = yaml.safe_load(rayjob.read_text())
    env = yaml.safe_load(body["spec"]["runtimeEnvYAML"])
    env["working_dir"] = "s3://someone-elses-bucket/code/job.zip"  # a hand edit, or a render from before the check
    body["spec"]["runtimeEnvYAML"] = yaml.safe_dump(env)
    rayjob.write_text(yaml.safe_dump(body))
    result = cli("rehearse", str(tmp_path / "out"), cwd=root, timeout=60)
    assert result.returncode == 2
    assert "runtime_env.working_dir: the pods' S3 role does not allow s3:GetObject on " \
           "s3://someone-elses-bucket/code/job.zip" in result.stderr
