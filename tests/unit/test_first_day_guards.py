"""A first day without surprises: one driver per run, and a bad data file refused before Ray starts.

Ray is never started here: a test that would start it fails instead (`ensure_ray` is replaced by a function that
raises), which is what these guards promise."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from trainlift.config.job import load_job_spec
from trainlift.errors import TrainliftError, UsageError
from trainlift.train import launch

ROOT = Path(__file__).resolve().parents[2]


def spec(tmp_path: Path, *overrides: str):
    return load_job_spec(ROOT / "examples" / "tiny-local.yaml",
                         [f"run.storage={tmp_path / 'runs'}", "run.name=guarded", *overrides])


def test_a_run_another_live_driver_trains_is_refused_before_anything_is_written(tmp_path):
    job = spec(tmp_path)
    run_dir = Path(job.run_uri)
    run_dir.mkdir(parents=True)
    started = time.time() - 60
    (run_dir / "driver.json").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(),
                                                     "started": started}))
    with pytest.raises(UsageError) as caught:
        with launch.driver_record(job):
            pass
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
    assert caught.value.message == f"run guarded is being trained by pid {os.getppid()} on {socket.gethostname()} " \
                                   f"since {stamp}"
    assert "another run.name" in caught.value.hint
    assert json.loads((run_dir / "driver.json").read_text())["pid"] == os.getppid()  # the other driver's record kept


def test_a_dead_drivers_record_does_not_hold_the_run(tmp_path):
    job = spec(tmp_path)
    run_dir = Path(job.run_uri)
    run_dir.mkdir(parents=True)
    (run_dir / "driver.json").write_text(json.dumps({"host": socket.gethostname(), "pid": 2**22 + 12345,
                                                     "started": time.time()}))
    with launch.driver_record(job) as taken_over:
        assert json.loads((run_dir / "driver.json").read_text())["pid"] == os.getpid()
    assert taken_over == (f"run guarded: its last driver (pid {2**22 + 12345} on {socket.gethostname()}) is gone "
                          "without ending it; this one takes the run over")
    assert not (run_dir / "driver.json").exists()


def test_a_bad_row_is_refused_before_ray_starts(tmp_path, monkeypatch):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                   '{"messages": [\n')

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started before the data was read")

    monkeypatch.setattr(launch, "ensure_ray", no_ray)
    job = spec(tmp_path, f"data.train={bad}", f"model.path={tmp_path / 'model'}")
    with pytest.raises(TrainliftError) as caught:
        launch.run_training(job)
    assert caught.value.message == f"{bad}:2: not valid JSON (Expecting value)"


def test_the_resume_hint_names_a_command_this_shell_can_run(tmp_path, monkeypatch):
    """After `make demo` the venv is not on PATH: the hint names `.venv/bin/trainlift`, as it was run."""
    from trainlift.cli.train import resume_command

    venv_bin = tmp_path / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "trainlift").write_text("#!/bin/sh\n")
    (venv_bin / "trainlift").chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    argv = [str(venv_bin / "trainlift"), "train", "examples/tiny-local.yaml", "--stop-at-step", "4"]
    assert resume_command(argv) == ".venv/bin/trainlift train examples/tiny-local.yaml"
    monkeypatch.setenv("PATH", f"{venv_bin}:/usr/bin:/bin")
    assert resume_command(argv) == "trainlift train examples/tiny-local.yaml"
    assert resume_command(["/x/trainlift/__main__.py", "train", "a.yaml"]) == "python -m trainlift train a.yaml"
