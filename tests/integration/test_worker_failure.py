"""A Ray Train worker SIGKILLed mid-run: FailureConfig restarts the group from the latest complete checkpoint
(found through ray.train.get_checkpoint()), at most `checkpoint.every_steps` steps are repeated, and the run
finishes with a loadable export."""

import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from trainlift.train.launch import run_training

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.slow]


def train_workers() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if "RayTrainWorker" in " ".join(p.cmdline() or []) and p.status() != psutil.STATUS_ZOMBIE]


def test_killed_worker_is_restarted_from_the_checkpoint(tiny_spec):
    spec = tiny_spec("run.name=killed", "train.steps=10", "checkpoint.every_steps=3", "run.max_failures=2")
    metrics = Path(spec.run_uri) / "metrics.jsonl"
    rng = random.Random(7)
    killed: list[tuple[int, float]] = []

    def kill_after_step(target: int) -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if metrics.exists() and any(json.loads(line).get("step", 0) >= target and "loss" in line
                                        for line in metrics.read_text().splitlines()):
                workers = train_workers()
                if workers:
                    victim = rng.choice(workers)
                    os.kill(victim.pid, signal.SIGKILL)
                    killed.append((victim.pid, time.time()))
                    return
            time.sleep(0.2)

    killer = threading.Thread(target=kill_after_step, args=(rng.randint(4, 5),), daemon=True)
    killer.start()
    summary = run_training(spec)
    killer.join(timeout=5)

    assert killed, "no worker was killed"
    assert summary["finished"] and summary["steps"] == 10
    assert summary["resumed_from"].endswith("checkpoint_00000003")
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if '"loss"' in line]
    repeated = len(steps) - len(set(steps))
    assert 0 < repeated <= 3 and sorted(set(steps)) == list(range(1, 11))
    assert (Path(spec.run_uri) / "final" / "model.safetensors").is_file()
