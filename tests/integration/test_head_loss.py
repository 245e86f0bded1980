"""A job that outlives its head: `trainlift local up`, `submit` a tiny run that checkpoints every 2 steps, SIGKILL
every process of that head (by pid: its `ray start` group, GCS, raylet, dashboard, workers, and the job's driver,
which Ray starts in a session of its own but which lives on the head as a pod's would), then:

- `jobs status` says the head is gone, in one line, exit 1, no traceback;
- `local up` again and `submit` the same spec: the run resumes at its last complete checkpoint step, keeps every
  checkpoint completed before the loss, and its losses after the resume equal an uninterrupted run's.

Run with -s for the figures: steps lost, seconds from the resubmit to the first step.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

pytestmark = pytest.mark.slow
STEPS, EVERY = 12, 2
REL = 1e-5  # same workers, same data order, state restored from DCP: only float summation order may differ


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(home: Path, *args: str, cwd: Path | None = None, timeout: float = 420) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRAINLIFT_HOME": str(home), "RAY_ADDRESS": ""}
    return subprocess.run([sys.executable, "-m", "trainlift", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)


def head_processes(pgid: int) -> list[psutil.Process]:
    """The head's process group and everything those processes started (the job's driver has its own session)."""
    group = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                group.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    found = {p.pid: p for p in group}
    for proc in group:
        try:
            found.update({c.pid: c for c in proc.children(recursive=True)})
        except psutil.Error:
            continue
    return list(found.values())


def kill_head(pgid: int) -> list[str]:
    procs = head_processes(pgid)
    names = []
    for proc in procs:
        try:
            names.append(proc.name())
            os.kill(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, psutil.Error):
            continue
    psutil.wait_procs(procs, timeout=30)
    return names


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def complete_checkpoints(run: Path) -> list[int]:
    return sorted(int(p.parent.name.split("_")[1]) for p in run.glob("checkpoint_*/COMPLETE"))


@pytest.fixture
def project(tiny_assets, tmp_path):
    shutil.copytree(tiny_assets / "model", tmp_path / "model")
    shutil.copy(tiny_assets / "train.jsonl", tmp_path / "train.jsonl")
    spec = {"model": {"path": "model"}, "data": {"train": "train.jsonl", "seq_len": 64},
            "train": {"steps": STEPS, "micro_batch_size": 2, "lr": 1e-3, "warmup_steps": 1, "seed": 0},
            "checkpoint": {"every_steps": EVERY, "keep": STEPS}, "run": {"name": "headloss", "storage": "runs"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    return tmp_path


@pytest.mark.timeout(1200)
def test_a_run_outlives_its_head_and_resumes_from_its_last_checkpoint(project, tmp_path):
    home, port = tmp_path / "home", free_port()
    run = project / "runs" / "headloss"
    up = cli(home, "local", "up", "--port", str(port), "--num-cpus", "4", "--json")
    assert up.returncode == 0, up.stderr
    try:
        submitted = json.loads(cli(home, "submit", "job.yaml", "--detach", "--json", cwd=project).stdout)
        deadline = time.monotonic() + 300
        while not complete_checkpoints(run) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert complete_checkpoints(run), "no checkpoint within 300 s"
        killed = kill_head(json.loads(up.stdout)["pid"])
        assert {"gcs_server", "raylet"} <= set(killed), killed
        done_before = complete_checkpoints(run)
        last_step = max(r["step"] for r in rows(run) if "loss" in r)
        assert last_step < STEPS, "the run finished before its head was killed"

        status = cli(home, "jobs", "status", submitted["submission_id"])
        lines = status.stderr.strip().splitlines()
        assert status.returncode == 1 and len(lines) == 1 and "Traceback" not in status.stderr, status.stderr
        assert "the head is gone or unreachable" in lines[0] and submitted["submission_id"] in lines[0]

        early = cli(home, "submit", "job.yaml", cwd=project)  # the head still gone: says so, and where it resumes
        assert early.returncode == 1 and len(early.stderr.strip().splitlines()) == 1, early.stderr
        assert f"resumes run 'headloss' from its checkpoint at step {done_before[-1]}" in early.stderr

        assert cli(home, "local", "up", "--port", str(port), "--num-cpus", "4").returncode == 0
        # The uninterrupted reference trains next to the resumed run (2 workers each: the head's 4 CPUs), a job of
        # its own: it shares nothing with the resumed run but the head, and its losses do not depend on timing.
        reference = cli(home, "submit", "job.yaml", "--detach", "--json", "--set", "run.name=reference", cwd=project)
        assert reference.returncode == 0, reference.stderr[-3000:]
        resumed = cli(home, "submit", "job.yaml", "--json", cwd=project)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        report = json.loads(resumed.stdout)
        reference_done = cli(home, "jobs", "logs", json.loads(reference.stdout)["submission_id"], "--follow")
        assert reference_done.returncode == 0, reference_done.stdout[-3000:]  # 0: the job SUCCEEDED
    finally:
        cli(home, "local", "down")

    resume_at = done_before[-1]
    starts = [r for r in rows(run) if r.get("event") == "start"]
    assert starts[-1]["step"] == resume_at and starts[-1]["resumed_from"].endswith(f"checkpoint_{resume_at:08d}")
    assert set(done_before) <= set(complete_checkpoints(run)), "a completed checkpoint was lost"
    after = rows(run)[rows(run).index(starts[-1]) + 1:]
    resumed_losses = {r["step"]: r["loss"] for r in after if "loss" in r}
    expected = {r["step"]: r["loss"] for r in rows(project / "runs" / "reference") if "loss" in r}
    assert sorted(resumed_losses) == list(range(resume_at + 1, STEPS + 1))
    worst = max(abs(resumed_losses[s] - expected[s]) / abs(expected[s]) for s in resumed_losses)
    assert worst <= REL, (resumed_losses, expected)
    print(f"\nhead killed after step {last_step}; resumed at checkpoint step {resume_at}: {last_step - resume_at} "
          f"step(s) lost; resubmit to first step {report['time_to_first_step_s']:.1f} s; losses after the resume vs "
          f"an uninterrupted run: max relative difference {worst:.1e}; killed: {sorted(set(killed))}")
