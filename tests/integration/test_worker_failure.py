"""Ray Train workers SIGKILLed mid-run: FailureConfig restarts the worker group from the newest complete checkpoint,
at most 2 x `checkpoint.every_steps` steps are repeated per failure (asynchronous checkpoints, the default: a kill
while a save is still uploading falls back to the one before), a checkpoint that was being written when the kill
landed is never resumed from, and the run finishes with an export that transformers loads.

Kills are seeded (random.Random) and land at random steps, on a random rank, at a random moment inside the step,
read off metrics.jsonl as the run goes. Run with -s to see the per-kill table (kill step, resume step, repeated
steps, seconds from the kill to the next logged step)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pyarrow.fs as pafs
import pytest
import torch

from trainlift.train.run import checkpoint
from trainlift.train.launch import run_training

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.slow]

K = 3  # checkpoint.every_steps in every test here
WORLD = 2  # tiny_spec's scaling.workers
TIMEOUT_S = 180  # any single wait of the killer thread; a stuck wait fails the test instead of hanging it
FS = pafs.LocalFileSystem()


@pytest.fixture(autouse=True)
def ray_default_poll(monkeypatch):
    """Ray Train's default 2 s controller poll, which the suite otherwise shortens: the lag it leaves between
    storage and Ray's reported checkpoint is what the resume logic must see through."""
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2.0")


# ---------------------------------------------------------------------------------------------------------------------
# Watching the run from the driver: its metrics rows and its worker processes


class Rows:
    """Training rows of metrics.jsonl ({"step", "loss", ..., "time"}), read incrementally as rank 0 appends them."""

    def __init__(self, path: Path):
        self.path, self.offset, self.rows, self._partial = path, 0, [], ""

    def poll(self) -> list[dict]:
        if self.path.exists():
            with open(self.path, encoding="utf-8") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
                self.offset = fh.tell()
            lines = (self._partial + chunk).split("\n")
            self._partial = lines.pop()  # an unterminated line is still being written
            self.rows += [row for row in map(json.loads, filter(None, lines)) if "loss" in row]
        return self.rows

    def last_step(self) -> int:
        rows = self.poll()
        return rows[-1]["step"] if rows else 0

    def first_after(self, t: float) -> dict:
        """The first row logged after time `t` (waits for it)."""
        return wait_for(lambda: next((r for r in self.poll() if r["time"] > t), None), f"a step logged after {t}",
                        poll_s=0.02)


def parse_rows(path: Path) -> list[dict]:
    """The whole file, strictly: a torn line here would be a bug worth seeing."""
    return [row for row in map(json.loads, path.read_text().splitlines()) if "loss" in row]


RUN_OVER = threading.Event()  # set once run_training has returned: a killer must never outlive its run


def wait_for(probe, what: str, poll_s: float = 0.005):
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if RUN_OVER.is_set():
            raise TimeoutError(f"the run ended while waiting for {what}")
        found = probe()
        if found:
            return found
        time.sleep(poll_s)
    raise TimeoutError(f"gave up waiting for {what}")


def train_workers() -> dict[int, psutil.Process]:
    found = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            if "RayTrainWorker" in " ".join(proc.cmdline()) and proc.status() != psutil.STATUS_ZOMBIE:
                found[proc.pid] = proc
        except psutil.Error:  # exited while we looked
            pass
    return found


def wait_new_group(old: set[int]) -> tuple[dict[int, psutil.Process], float]:
    """The next worker group (WORLD RayTrainWorker processes none of which is in `old`) and when it was seen."""
    group = wait_for(lambda: (lambda new: new if len(new) == WORLD else None)(
        {pid: p for pid, p in train_workers().items() if pid not in old}), "a new worker group", poll_s=0.1)
    return group, time.time()


def rank0_pid(group: dict[int, psutil.Process], metrics_path: Path) -> int:
    """Rank 0 is the worker that holds metrics.jsonl open for appending."""
    def probe():
        for pid, proc in group.items():
            try:
                if any(f.path == os.path.realpath(metrics_path) for f in proc.open_files()):
                    return pid
            except psutil.Error:
                pass
        return None

    return wait_for(probe, "rank 0 to open metrics.jsonl", poll_s=0.05)


def by_rank(group: dict[int, psutil.Process], metrics_path: Path) -> list[int]:
    zero = rank0_pid(group, metrics_path)
    return [zero] + sorted(pid for pid in group if pid != zero)


def latest_complete_step(run_dir: Path) -> int:
    latest = checkpoint.latest_complete(FS, str(run_dir))
    return latest[0] if latest else 0


class Killer(threading.Thread):
    """Runs `plan` next to run_training; an exception in it fails the test after the run returns."""

    def __init__(self, plan):
        super().__init__(daemon=True)
        self.plan, self.error = plan, None
        RUN_OVER.clear()

    def run(self) -> None:
        try:
            self.plan()
        except BaseException as exc:  # noqa: BLE001 - reported by finish()
            self.error = exc

    def finish(self) -> None:
        RUN_OVER.set()
        self.join(timeout=TIMEOUT_S)
        assert not self.is_alive(), "the killer thread is still waiting"
        if self.error is not None:
            raise self.error


def train_while(plan, spec) -> tuple[dict, float]:
    """run_training(spec) with `plan` running next to it; returns the summary and the run's wall time."""
    killer = Killer(plan)
    killer.start()
    started = time.monotonic()
    try:
        summary = run_training(spec)
    finally:
        RUN_OVER.set()
    wall = time.monotonic() - started
    killer.finish()
    return summary, wall


# ---------------------------------------------------------------------------------------------------------------------
# Per-kill bookkeeping: what the metrics sequence says about each failure


@dataclass
class Kill:
    rank: int
    target: int  # kill once this step is logged ...
    delay_s: float  # ... and this much later, so the kill lands anywhere in the step (or in a checkpoint save)
    t_kill: float
    t_restart: float  # when the next worker group was first seen
    complete_at_restart: int  # the newest complete checkpoint's step at that moment (0: none)
    killed_at: int = 0  # last step the killed group logged
    resumed_at: int = 0  # step the next group resumed from (its first logged step - 1)
    repeated: int = 0
    recovery_s: float = 0.0  # kill -> the next group's first logged step


def analyse(rows: list[dict], kills: list[Kill], total_steps: int) -> None:
    """Split the metrics sequence into one segment per worker group and fill in each kill's numbers.

    Every group logs consecutive steps; a group's first step is one past the checkpoint it resumed from."""
    bounds = [next(i for i, r in enumerate(rows) if r["time"] > k.t_restart) for k in kills]
    segments = [rows[a:b] for a, b in zip([0] + bounds, bounds + [len(rows)])]
    for segment in segments:
        steps = [r["step"] for r in segment]
        assert steps and steps == list(range(steps[0], steps[0] + len(steps))), f"steps not consecutive: {steps}"
    assert segments[0][0]["step"] == 1 and segments[-1][-1]["step"] == total_steps
    for kill, before, after in zip(kills, segments, segments[1:]):
        kill.killed_at, kill.resumed_at = before[-1]["step"], after[0]["step"] - 1
        kill.repeated = kill.killed_at - kill.resumed_at
        kill.recovery_s = after[0]["time"] - kill.t_kill


def print_table(title: str, kills: list[Kill]) -> None:
    print(f"\n{title}\n  kill  rank  killed_at  resumed_from  repeated  new_group_s  recovery_s")
    for i, k in enumerate(kills, 1):
        print(f"  {i:>4}  {k.rank:>4}  {k.killed_at:>9}  {k.resumed_at:>12}  {k.repeated:>8}"
              f"  {k.t_restart - k.t_kill:>11.2f}  {k.recovery_s:>10.2f}")


def assert_export_loads(run_dir: Path) -> None:
    """The export after the kills holds the weights of the run's last complete checkpoint (its final step)."""
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    last = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    _, last_path = checkpoint.latest_complete(FS, str(run_dir))
    checkpoint.load_weights_unsharded(last_path, last)
    for (name, weight), (_, expected) in zip(exported.state_dict().items(), last.state_dict().items()):
        torch.testing.assert_close(weight, expected, rtol=0, atol=0, msg=name)


# ---------------------------------------------------------------------------------------------------------------------
# 1. Repeated kills at random moments


KILLS_PER_RUN = 5
STEPS = 40  # a kill lands about 2K steps at most past a group's first step: room for 5 of them


# One seed, five kills: every kill costs a worker-group restart (about 10 s on 2 cores), so a second seed would
# double the test's time for cases this one already hits. Seed 5 kills rank 1 once and rank 0 four times, at 1 to 2K
# steps into a worker group, twice exactly 2K steps in: just after its second checkpoint is complete and before Ray
# Train's controller (which collects reports on a 2 s poll) has registered it, so ray.train.get_checkpoint() in the
# next group still names the first one.
SEED = 5


def test_random_worker_kills_resume_from_the_newest_complete_checkpoint(tiny_spec):
    """Five SIGKILLs of a random Ray Train worker at random steps in one run: after every one the worker group
    restarts from the newest complete checkpoint, repeats at most 2 x checkpoint.every_steps steps (the save in
    flight when the kill lands is lost with it), and the run still
    reaches its last step and exports a model that transformers loads."""
    seed = SEED
    spec = tiny_spec(f"run.name=chaos-{seed}", f"train.steps={STEPS}", f"checkpoint.every_steps={K}",
                     f"run.max_failures={KILLS_PER_RUN}")
    run_dir = Path(spec.run_uri)
    metrics = run_dir / "metrics.jsonl"
    rng = random.Random(seed)
    kills: list[Kill] = []

    def plan() -> None:
        rows = Rows(metrics)
        group, seen = wait_new_group(set())
        for _ in range(KILLS_PER_RUN):
            first = rows.first_after(seen)["step"]  # this group is training
            rank, target, delay = rng.randrange(WORLD), first + rng.randint(1, 2 * K), rng.uniform(0.0, 0.05)
            victim = by_rank(group, metrics)[rank]
            wait_for(lambda: rows.last_step() >= target, f"step {target}", poll_s=0.002)
            time.sleep(delay)
            if rows.last_step() >= STEPS - 2:
                raise AssertionError(f"step {rows.last_step()} is too close to the end to kill (steps={STEPS})")
            os.kill(victim, signal.SIGKILL)
            t_kill = time.time()
            group, seen = wait_new_group(set(group))
            kills.append(Kill(rank, target, delay, t_kill, seen, latest_complete_step(run_dir)))
        rows.first_after(seen)

    summary, wall = train_while(plan, spec)

    assert len(kills) == KILLS_PER_RUN
    assert summary["finished"] and summary["steps"] == STEPS
    analyse(parse_rows(metrics), kills, STEPS)
    print_table(f"seed {seed}: {STEPS} steps, K={K}, {len(kills)} kills, run {wall:.1f} s", kills)
    for k in kills:
        assert k.killed_at < STEPS, "the kill landed after training ended"
        assert k.resumed_at == k.complete_at_restart, "did not resume from the newest complete checkpoint"
        assert k.resumed_at % K == 0 and 0 <= k.repeated <= 2 * K
    last = kills[-1].resumed_at
    assert summary["resumed_from"] == (str(run_dir / checkpoint.dir_name(last)) if last else None)
    assert_export_loads(run_dir)


# ---------------------------------------------------------------------------------------------------------------------
# 2. A kill while a checkpoint is being committed


SHARDS = {".metadata", "trainer_state.json"} | {f"__{r}_0.distcp" for r in range(WORLD)} | {
    f"rng_rank{r}.pt" for r in range(WORLD)}
LEFTOVER = "leftover-of-the-killed-save"
_CKPT = re.compile(r"^checkpoint_(\d{8})$")


def test_kill_between_shard_upload_and_commit_resumes_from_the_previous_checkpoint(tiny_spec):
    """A worker SIGKILLed after every rank's shards of a checkpoint are in storage but before its COMPLETE marker:
    the restart resumes from the checkpoint before it, the half-written directory is deleted (not merged into) and
    written again from scratch, and the run finishes."""
    steps, attempts = 15, 3  # checkpoints 6, 9 and 12 are chances to land the kill
    spec = tiny_spec("run.name=midsave", f"train.steps={steps}", f"checkpoint.every_steps={K}", "checkpoint.keep=100",
                     f"run.max_failures={attempts}")
    run_dir = Path(spec.run_uri)
    metrics = run_dir / "metrics.jsonl"
    rng = random.Random(99)
    hit: dict = {}
    misses: list[int] = []

    def half_written() -> int | None:
        """Step of a checkpoint directory that has every shard but no COMPLETE marker."""
        for entry in os.scandir(run_dir):
            match = _CKPT.match(entry.name)
            if match and int(match.group(1)) >= 2 * K and int(match.group(1)) not in misses:
                try:
                    names = set(os.listdir(entry.path))
                except FileNotFoundError:
                    continue
                if checkpoint.MARKER not in names and SHARDS <= names:
                    return int(match.group(1))
        return None

    def plan() -> None:
        rows = Rows(metrics)
        group, seen = wait_new_group(set())
        for _ in range(attempts):
            rows.first_after(seen)
            rank = rng.randrange(WORLD)
            victim = by_rank(group, metrics)[rank]
            step = wait_for(lambda: run_dir.exists() and half_written(), "a half-written checkpoint", poll_s=0.002)
            os.kill(victim, signal.SIGKILL)
            t_kill = time.time()
            leftover = run_dir / checkpoint.dir_name(step) / LEFTOVER  # stands for any partial file of the torn save
            leftover.write_text("x")
            group, seen = wait_new_group(set(group))
            if (run_dir / checkpoint.dir_name(step) / checkpoint.MARKER).exists():
                misses.append(step)  # the marker beat the kill: this checkpoint is complete, try the next one
                leftover.unlink()
                continue
            hit.update(step=step, rank=rank, t_kill=t_kill, t_restart=seen)
            hit["first"] = rows.first_after(seen)
            return

    summary, wall = train_while(plan, spec)

    assert hit, f"no kill landed between upload and commit (missed at steps {misses})"
    step, previous = hit["step"], hit["step"] - K
    print(f"\nmid-checkpoint kill: rank {hit['rank']} killed while checkpoint {step} awaited its marker "
          f"(missed before: {misses}); resumed at step {hit['first']['step'] - 1}, "
          f"recovery {hit['first']['time'] - hit['t_kill']:.2f} s, run {wall:.1f} s")
    assert summary["finished"] and summary["steps"] == steps
    assert summary["resumed_from"] == str(run_dir / checkpoint.dir_name(previous))
    assert hit["first"]["step"] == previous + 1
    redone = run_dir / checkpoint.dir_name(step)
    assert not (redone / LEFTOVER).exists(), "the next save merged into the killed save's directory"
    marker = json.loads((redone / checkpoint.MARKER).read_text())
    assert marker["step"] == step and marker["time"] > hit["t_restart"]
    assert all(done for _, _, done in checkpoint.list_checkpoints(FS, str(run_dir)))
    assert_export_loads(run_dir)
