"""`submit --env`: plain settings reach the job; a secret never does, because the job's runtime_env (env_vars
included) is shown by the Ray dashboard to whoever can open it. Secrets come from a Kubernetes Secret (the cluster
spec's `secrets`) or from the environment the Ray nodes were started in."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from trainlift.errors import UsageError
from trainlift.ops import jobs

PLANTED = "hf_plantedsecretvalue0123456789"


def submit_cli(tmp_path, *args, **env):
    (tmp_path / "job.yaml").write_text("model: {path: m}\ndata: {train: t.jsonl}\n")
    return subprocess.run([sys.executable, "-m", "trainlift", "submit", "job.yaml", "--address", "http://127.0.0.1:9",
                           *args], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={**os.environ, "RAY_ADDRESS": "", **env})


def test_a_secret_named_env_from_the_shell_is_refused_in_one_line_naming_the_fix(tmp_path):
    result = submit_cli(tmp_path, "--env", "HF_TOKEN", HF_TOKEN=PLANTED)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--env HF_TOKEN" in lines[0] and "runtime_env" in lines[0]
    assert "Kubernetes Secret" in lines[0] and "`secrets`" in lines[0] and "trainlift local up" in lines[0]
    assert PLANTED not in result.stdout + result.stderr
    assert "cannot reach" not in result.stderr  # refused before any connection


@pytest.mark.parametrize("name", ["HF_TOKEN", "WANDB_API_KEY", "MLFLOW_TRACKING_PASSWORD", "AWS_SECRET_ACCESS_KEY",
                                  "OPENAI_KEY", "DB_CREDENTIALS", "GITHUB_PAT_SECRET"])
def test_secret_names_are_refused_whatever_their_value(name):
    for pair, environ in ((name, {name: "x"}), (f"{name}=x", {})):
        with pytest.raises(UsageError, match=rf"--env {name}: "):
            jobs.parse_env([pair], environ)


def test_a_token_shaped_value_is_refused_under_any_name_without_echoing_it():
    for pair, environ in ((f"MY_SETTING={PLANTED}", {}), ("MY_SETTING", {"MY_SETTING": PLANTED})):
        with pytest.raises(UsageError) as refused:
            jobs.parse_env([pair], environ)
        assert PLANTED not in refused.value.one_line()


def test_plain_settings_pass_from_the_command_line_or_the_shell():
    env = jobs.parse_env(["LOG_LEVEL=debug", "HF_HUB_OFFLINE", "KEYBOARD_LAYOUT=us"], {"HF_HUB_OFFLINE": "1"})
    assert env == {"LOG_LEVEL": "debug", "HF_HUB_OFFLINE": "1", "KEYBOARD_LAYOUT": "us"}


@pytest.mark.parametrize("pair, message", [("1BAD=x", "expected KEY=VALUE"), ("UNSET_HERE", "not set in this shell")])
def test_malformed_or_unset_env_is_refused(pair, message):
    with pytest.raises(UsageError, match=message):
        jobs.parse_env([pair], {})
