"""`trainlift doctor --storage`: the run storage probed with each node's own credentials against an S3 server over
HTTP (moto, checking credentials and IAM user policies): HeadBucket, then put, get and delete of a probe object,
and one finding per refusal naming the permission the role lacks.

moto authorises HeadBucket as its own "s3:HeadBucket", AWS as s3:ListBucket with no s3:prefix: the restricted
policy below grants neither, so both refuse it, and the finding names AWS's permission."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import boto3
import pytest

h = runpy.run_path(str(Path(__file__).with_name("conftest_aws.py")))["load"]()
nodes = runpy.run_path(str(Path(__file__).with_name("ray_nodes.py")))
TRAINLIFT = os.path.join(os.path.dirname(sys.executable), "trainlift")
BUCKET = "run-bucket"
# What a role of the old render's shape lets through, without any listing and without delete.
PUT_AND_GET = [{"Effect": "Allow", "Action": ["s3:PutObject", "s3:GetObject"],
                "Resource": f"arn:aws:s3:::{BUCKET}/runs/*"}]
EVERYTHING = [{"Effect": "Allow", "Action": "s3:*", "Resource": [f"arn:aws:s3:::{BUCKET}", f"arn:aws:s3:::{BUCKET}/*"]}]


def pod_credentials(name: str, statements: list[dict]) -> dict[str, str]:
    """An IAM user standing in for the pods' role: its keys, for a process's environment."""
    iam = boto3.client("iam", region_name="us-east-1")
    iam.create_user(UserName=name)
    iam.put_user_policy(UserName=name, PolicyName="storage", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": statements}))
    key = iam.create_access_key(UserName=name)["AccessKey"]
    return {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}


@pytest.fixture
def s3_server(monkeypatch, tmp_path):
    """The session's moto server with the run bucket, checking credentials and policies until the test ends."""
    env = h.use_bucket(monkeypatch, tmp_path, BUCKET)
    env = {**env, "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1"}
    yield env
    h.reject_credentials(False)


def doctor(env: dict[str, str], *args: str) -> tuple[int, dict]:
    proc = subprocess.run([TRAINLIFT, "doctor", *args, "--json"], env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.stdout, proc.stderr[-2000:]
    return proc.returncode, json.loads(proc.stdout)


def storage(report: dict) -> list[dict]:
    return [f for f in report["findings"] if f["rule"] == "storage_access"]


def test_each_refused_request_is_one_finding_naming_the_missing_permission(s3_server):
    pod, admin = pod_credentials("pod", PUT_AND_GET), pod_credentials("admin", EVERYTHING)
    h.reject_credentials(True)
    code, report = doctor({**os.environ, **s3_server, **pod}, "--storage", f"s3://{BUCKET}/runs")
    found = storage(report)
    assert code == 1 and [f["severity"] for f in found] == ["error", "error"]
    delete, head = sorted(found, key=lambda f: f["message"])
    assert head["message"] == (f"HeadBucket on s3://{BUCKET}/runs: access denied: the role lacks s3:ListBucket on "
                               f"arn:aws:s3:::{BUCKET}")
    assert "with no s3:prefix condition" in head["fix"] and "HeadBucket" in head["fix"]
    assert delete["message"].startswith(f"DeleteObject on s3://{BUCKET}/runs: access denied: the role lacks "
                                        f"s3:DeleteObject on arn:aws:s3:::{BUCKET}/runs/.trainlift-doctor/")
    assert "is left behind" in delete["fix"]
    calls = {c["call"]: c["ok"] for c in report["facts"]["storage"]["calls"]}
    assert calls == {"HeadBucket": False, "PutObject": True, "GetObject": True, "DeleteObject": False}

    code, report = doctor({**os.environ, **s3_server, **admin}, "--storage", f"s3://{BUCKET}/runs")
    [ok] = storage(report)
    assert ok["severity"] == "ok" and "HeadBucket, and a put, get and delete" in ok["message"]
    h.reject_credentials(False)
    left = boto3.client("s3", region_name="us-east-1").list_objects_v2(Bucket=BUCKET).get("Contents", [])
    assert len(left) == 1  # the restricted role's probe object, which it could not delete; the admin's is gone


def test_the_job_specs_run_storage_is_probed_and_a_bad_uri_is_one_line(s3_server, tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text(f"model: {{path: m}}\ndata: {{train: t.jsonl}}\nrun: {{storage: s3://{BUCKET}/team}}\n")
    code, report = doctor({**os.environ, **s3_server}, "--job", str(spec))
    assert report["facts"]["storage"]["uri"] == f"s3://{BUCKET}/team" and storage(report)[0]["severity"] == "ok"
    bad = subprocess.run([TRAINLIFT, "doctor", "--storage", "runs/"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--storage 'runs/' is not an s3:// URI" in bad.stderr


@pytest.mark.timeout(300)
def test_every_node_probes_the_storage_with_its_own_credentials(s3_server):
    """A head whose credentials lack listing and delete, a worker whose do not: only the head is named. The
    command's own process holds no credentials at all."""
    pod, worker = pod_credentials("pod", PUT_AND_GET), pod_credentials("worker", EVERYTHING)
    h.reject_credentials(True)
    node_env = {k: v for k, v in s3_server.items() if not k.startswith("AWS_ACCESS") and k != "AWS_SECRET_ACCESS_KEY"}
    with nodes["two_local_nodes"](head_env={**node_env, **pod}, worker_env={**node_env, **worker}) as address:
        env = nodes["env"]()
        env = {k: v for k, v in env.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
        code, report = doctor(env, "--address", address, "--storage", f"s3://{BUCKET}/runs")
    head, other = report["nodes"]
    found = storage(report)
    assert code == 1 and head["is_head"]
    assert {(f["node"], f["severity"]) for f in found} == {
        (head["name"], "error"), (other["name"], "ok")}
    assert sorted(f["message"].split(": ")[-1].split(" on ")[0] for f in found if f["severity"] == "error") == [
        "the role lacks s3:DeleteObject", "the role lacks s3:ListBucket"]
