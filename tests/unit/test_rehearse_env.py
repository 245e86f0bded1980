"""The environment a rehearsal's Ray processes get (ops/rehearse_cluster.py): what a pod has, not this shell's.
No AWS key, HF_TOKEN or other variable of the shell; Ray's token required, never disabled; S3 reached as this
environment reaches it, its credentials in a private file that boto3 reads as the pods' SDKs would."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from trainlift.ops.rehearse_cluster import ray_process_env

SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYplantedSECRET"


@pytest.fixture
def shell(tmp_path, monkeypatch):
    """A user's shell: AWS keys, an HF token, a Ray that another tool told to run without a token."""
    home = tmp_path / "home"
    home.mkdir()
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    env = {"HOME": str(home), "AWS_ACCESS_KEY_ID": "AKIAPLANTEDKEY", "AWS_SECRET_ACCESS_KEY": SECRET,
           "AWS_REGION": "us-east-2", "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "HF_TOKEN": "hf_plantedtoken",
           "AWS_CONFIG_FILE": str(tmp_path / "no-config"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
           "RAY_AUTH_MODE": "disabled", "MY_SHELL_VARIABLE": "x"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return home


def test_the_ray_processes_get_no_secret_of_the_shell_and_require_the_token(shell, tmp_path):
    temp = tmp_path / "rehearsal"
    temp.mkdir(mode=0o700)
    env = ray_process_env(str(temp))
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN", "MY_SHELL_VARIABLE"} & set(env)
    assert not [name for name, value in env.items() if SECRET in value or "hf_planted" in value]
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_ADDRESS"] == ""
    token = env["RAY_AUTH_TOKEN_PATH"]
    assert token == str(shell / ".ray" / "auth_token") and stat.S_IMODE(os.stat(token).st_mode) == 0o600
    assert env["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9" and env["AWS_REGION"] == "us-east-2"
    assert env["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable) and env["HOME"] == str(shell)

    credentials = env["AWS_SHARED_CREDENTIALS_FILE"]
    assert stat.S_IMODE(os.stat(credentials).st_mode) == 0o600 and credentials.startswith(str(temp))
    read = subprocess.run([sys.executable, "-c", "import boto3; c = boto3.session.Session().get_credentials(); "
                           "print(c.access_key, c.secret_key)"], env=env, capture_output=True, text=True, timeout=60)
    assert read.stdout.split() == ["AKIAPLANTEDKEY", SECRET], read.stderr  # what the pods' SDKs read instead


def test_a_shell_without_aws_credentials_hands_over_none(shell, tmp_path, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    env = ray_process_env(str(tmp_path))
    read = subprocess.run([sys.executable, "-c", "import boto3; print(boto3.session.Session().get_credentials())"],
                          env={**env, "AWS_EC2_METADATA_DISABLED": "true"}, capture_output=True, text=True, timeout=60)
    assert read.stdout.strip() == "None", read.stderr
