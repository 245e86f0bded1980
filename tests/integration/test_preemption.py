"""Preemption: SIGTERM to `trainlift train` checkpoints at the next step boundary, exits 3, and a rerun resumes.
The signal lands while the step-3 asynchronous checkpoint is still being written (its first save also starts DCP's
checkpointing processes): the stop waits for it, then writes the final one, and both are complete."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

pytestmark = pytest.mark.slow


def test_sigterm_checkpoints_exits_3_and_the_rerun_resumes(tiny_assets, tmp_path):
    spec = {"model": {"path": str(tiny_assets / "model")},
            "data": {"train": str(tiny_assets / "train.jsonl"), "seq_len": 64},
            "train": {"steps": 400, "micro_batch_size": 2, "warmup_steps": 1},
            "checkpoint": {"every_steps": 3, "keep": 10}, "run": {"name": "pre", "storage": str(tmp_path / "runs")}}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "RAY_ADDRESS": "", "TRAINLIFT_HOME": str(tmp_path / "home")}
    metrics = tmp_path / "runs" / "pre" / "metrics.jsonl"

    proc = subprocess.Popen([sys.executable, "-m", "trainlift", "train", str(job)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (metrics.exists() and '"event": "checkpoint"' in metrics.read_text()):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.5)
    in_flight = not (tmp_path / "runs" / "pre" / "checkpoint_00000003" / "COMPLETE").exists()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert in_flight, "the step-3 checkpoint was complete before the signal: nothing was in flight"
    assert (tmp_path / "runs" / "pre" / "checkpoint_00000003" / "COMPLETE").is_file()
    assert proc.returncode == 3, stderr[-2000:]
    # run as `python -m trainlift`, the hint says so (a `trainlift` on PATH may not be this environment's)
    assert "SIGTERM received" in stderr and "resume with: python -m trainlift train" in stderr

    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if '"loss"' in line]
    stopped_at = max(steps)
    assert stopped_at < 400
    assert (tmp_path / "runs" / "pre" / f"checkpoint_{stopped_at:08d}" / "COMPLETE").is_file()

    rerun = subprocess.run([sys.executable, "-m", "trainlift", "train", str(job), "--steps", str(stopped_at + 2),
                            "--json"], env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    summary = json.loads(rerun.stdout)
    assert summary["resumed_from"].endswith(f"checkpoint_{stopped_at:08d}") and summary["steps"] == stopped_at + 2
    # Piped, not asked for machine lines: human progress lines only, the last step's always among them.
    assert "trainlift-progress" not in stderr + rerun.stderr
    assert f"resumed at step {stopped_at} on 2 workers" in rerun.stderr
    assert f"step {stopped_at + 2}/{stopped_at + 2}  loss " in rerun.stderr
