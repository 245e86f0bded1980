"""`trainlift train` on bad input: one clear line, exit code 2, no traceback, nothing started."""

import json
import os
import re
import subprocess
import sys

import pytest
import yaml



def run_cli(*args, cwd=None):
    env = {**os.environ, "RAY_ADDRESS": ""}
    return subprocess.run([sys.executable, "-m", "trainlift", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=120)


@pytest.fixture
def spec_file(tiny_assets, tmp_path):
    def write(mutate=lambda spec: None):
        spec = {
            "model": {"path": str(tiny_assets / "model")},
            "data": {"train": str(tiny_assets / "train.jsonl"), "seq_len": 64},
            "train": {"steps": 2},
            "run": {"storage": str(tmp_path / "runs")},
        }
        mutate(spec)
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(spec))
        return path

    return write


def bad_jsonl(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n{oops\n")
    return str(path)


def read_only_dir(tmp_path):
    path = tmp_path / "ro"
    path.mkdir()
    (path / "run").write_text("a file where the run directory should go")
    return str(path)


CASES = {
    "unknown key": (lambda s, t: s["train"].update(stepz=3), r"train.stepz: unknown key"),
    "wrong type": (lambda s, t: s["train"].update(steps="ten"), r"train.steps: .*integer"),
    "missing data file": (lambda s, t: s["data"].update(train=str(t / "nope.jsonl")), r"data file not found: .*nope.jsonl"),
    "malformed jsonl": (lambda s, t: s["data"].update(train=bad_jsonl(t)), r"bad.jsonl:3: not valid JSON"),
    "seq_len too long": (lambda s, t: s["data"].update(seq_len=4096), r"data.seq_len: 4096 is above the model's maximum of 128"),
    "unwritable run dir": (lambda s, t: s["run"].update(storage=read_only_dir(t)), r"run.storage: cannot write to"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_gives_one_line_and_exit_2(case, spec_file, tmp_path):
    import re

    mutate, pattern = CASES[case]
    result = run_cli("train", str(spec_file(lambda s: mutate(s, tmp_path))))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and re.search(pattern, lines[0]), result.stderr


def test_missing_spec_file(tmp_path):
    result = run_cli("train", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2 and "no such spec file" in result.stderr and "Traceback" not in result.stderr


def test_help_teaches_the_command():
    result = run_cli("train", "--help")
    assert result.returncode == 0
    for flag in ("--set", "--steps", "--workers", "--run-dir", "--json", "--address"):
        assert flag in result.stdout


@pytest.mark.parametrize("flags,pattern", [
    (["--workers", "0"], r"scaling.workers: must be at least 1"),
    (["--workers", "-3"], r"scaling.workers: must be at least 1"),
    (["--steps", "0"], r"train.steps: "),
])
def test_every_flag_goes_through_the_spec_validation_before_ray_starts(flags, pattern, spec_file):
    result = run_cli("train", str(spec_file()), *flags)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and re.search(pattern, lines[0]) and "Traceback" not in result.stderr, result.stderr
