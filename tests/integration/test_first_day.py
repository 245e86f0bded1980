"""What a researcher does on the first day, through the CLI as they run it: Ctrl-C in a terminal, stopping and
resuming with the command trainlift prints, and running a finished run's command again."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import shlex
import shutil
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import yaml

BIN = Path(sys.executable).parent


def write_spec(tiny_assets, directory: Path, name: str, **train) -> Path:
    spec = {"model": {"path": str(tiny_assets / "model")},
            "data": {"train": str(tiny_assets / "train.jsonl"), "seq_len": 64},
            "train": {"micro_batch_size": 2, "warmup_steps": 1, **train},
            "run": {"name": name, "storage": str(directory / "runs")}}
    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_ADDRESS": "", "TRAINLIFT_HOME": str(cwd / "home")}
    return subprocess.run(args, capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def test_stop_resume_with_the_printed_command_then_a_rerun_leaves_the_finished_run_alone(tiny_assets, tmp_path):
    """The spec's paths are relative to its own directory, and the commands run from another one."""
    project = tmp_path / "project"
    shutil.copytree(tiny_assets / "model", project / "model")
    shutil.copy(tiny_assets / "train.jsonl", project / "train.jsonl")
    shutil.copy(tiny_assets / "eval.jsonl", project / "eval.jsonl")
    (project / "job.yaml").write_text(yaml.safe_dump({
        "model": {"path": "model"}, "data": {"train": "train.jsonl", "eval": "eval.jsonl", "seq_len": 64,
                                             "eval_examples": 8},
        "train": {"steps": 4, "micro_batch_size": 2, "warmup_steps": 1},
        "run": {"name": "firstday", "storage": "runs"}}))
    stopped = run([str(BIN / "trainlift"), "train", "project/job.yaml", "--stop-at-step", "2"], tmp_path)
    assert stopped.returncode == 3, stopped.stderr
    advice = re.search(r"resume with: (.+)$", stopped.stderr.strip(), re.M)
    # The program as this shell can run it: `trainlift` where that is on PATH, else the path it was run by.
    program = "trainlift" if shutil.which("trainlift") == str(BIN / "trainlift") else str(BIN / "trainlift")
    assert advice and advice.group(1) == f"{program} train project/job.yaml", stopped.stderr

    assert "Ray: starting an embedded local Ray in this process" in stopped.stderr
    stopped_summary = json.loads((project / "runs" / "firstday" / "summary.json").read_text())
    assert stopped_summary["initial_eval_loss"] is not None and stopped_summary["eval_loss"] is None

    resumed = run([*shlex.split(advice.group(1)), "--json"], tmp_path)  # the printed command, as printed
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads(resumed.stdout)
    assert summary["steps"] == 4  # on to train.steps, not one step past the stop
    assert summary["initial_eval_loss"] == stopped_summary["initial_eval_loss"] and summary["eval_loss"] is not None

    run_dir = project / "runs" / "firstday"
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    again = run([str(BIN / "trainlift"), "train", "job.yaml"], project)
    assert again.returncode == 0, again.stderr
    assert "already finished at step 4" in again.stderr and "--steps" in again.stderr
    assert "train.schedule_extension" in " ".join(again.stderr.split())
    changed = run([str(BIN / "trainlift"), "train", "job.yaml", "--set", "train.lr=0.01", "--steps", "6"], project)
    assert changed.returncode == 2 and changed.stderr.strip().splitlines()[0].startswith(
        "error: run firstday was started with another spec: train.lr 0.0003 → 0.01 (train it with the spec it "
        "started with, give this one another run.name, or pass --allow-spec-change"), changed.stderr
    # Byte for byte: summary.json, and driver.log, which every start of Ray adds a header to.
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before
    json.loads(before["summary.json"], parse_constant=lambda c: pytest.fail(f"summary.json holds {c}"))


def read_until(fd: int, pattern: str, timeout_s: float, seen: list[str]) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                seen.append(os.read(fd, 65536).decode(errors="replace"))
            except OSError:  # the child closed the terminal
                break
        found = re.search(pattern, "".join(seen))
        if found:
            return found
    pytest.fail(f"no {pattern!r} within {timeout_s} s; output: {''.join(seen)[-2000:]}")


def in_a_terminal(args: list[str], cwd: Path) -> tuple[subprocess.Popen, int]:
    """`args` as the foreground job of a new pseudo-terminal, as a shell runs it: Ctrl-C on the terminal sends
    SIGINT to its whole process group."""
    controller, terminal = pty.openpty()

    def take_the_terminal():
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    env = {**os.environ, "RAY_ADDRESS": "", "TRAINLIFT_HOME": str(cwd / "home"), "TERM": "xterm"}
    proc = subprocess.Popen(args, stdin=terminal, stdout=terminal, stderr=terminal, cwd=cwd, env=env,
                            preexec_fn=take_the_terminal)
    os.close(terminal)
    return proc, controller


def test_ctrl_c_in_a_terminal_checkpoints_at_the_next_step_and_exits_3(tiny_assets, tmp_path):
    write_spec(tiny_assets, tmp_path, "ctrlc", steps=400)
    proc, terminal = in_a_terminal([str(BIN / "trainlift"), "train", "job.yaml", "--progress", "lines",
                                    "--log-every", "0", "--set", "checkpoint.every_steps=1000"], tmp_path)
    seen: list[str] = []
    try:
        read_until(terminal, r"step ([5-9]|\d\d+)/400", 240, seen)
        os.write(terminal, b"\x03")  # Ctrl-C: the terminal sends SIGINT to the foreground process group
        read_until(terminal, r"stopped at step \d+", 120, seen)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(terminal)
    output = "".join(seen)
    stopped_at = int(re.search(r"stopped at step (\d+)", output).group(1))
    assert proc.returncode == 3, output[-2000:]
    assert "SIGINT: saving a checkpoint at the next step boundary" in output and "Traceback" not in output
    assert 5 <= stopped_at < 400
    checkpoints = sorted((tmp_path / "runs" / "ctrlc").glob("checkpoint_0*"))
    assert checkpoints[-1].name == f"checkpoint_{stopped_at:08d}" and (checkpoints[-1] / "COMPLETE").is_file()
    summary = json.loads((tmp_path / "runs" / "ctrlc" / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGINT" and not summary["finished"]


def test_two_trainings_started_together_on_one_run_one_is_refused(tiny_assets, tmp_path):
    """Two `trainlift train` of one run at the same moment: one trains, the other is refused in one line before it
    writes anything; the run's metrics hold each step once and one start."""
    spec = write_spec(tiny_assets, tmp_path, "twice", steps=4)
    env = {**os.environ, "RAY_ADDRESS": "", "TRAINLIFT_HOME": str(tmp_path / "home")}
    procs = [subprocess.Popen([str(BIN / "trainlift"), "train", str(spec), "--json"], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    done = sorted((p.wait(timeout=300), p.stderr.read()) for p in procs)
    (trained, _), (refused, said) = done
    assert (trained, refused) == (0, 2), done
    assert said.strip().splitlines()[-1].startswith("error: run twice is being trained by pid "), said
    rows = [json.loads(line) for line in (tmp_path / "runs" / "twice" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == [1, 2, 3, 4] and sum(r.get("event") == "start" for r in rows) == 1
