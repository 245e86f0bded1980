"""`trainlift train`'s progress when its output is not a terminal (a log file, a Ray job's log).

Two forms: a human line every few seconds (step/total, loss, a DPO run's reward accuracy and margin, the latest
evaluation, tokens/s, ETA), or, when the reader asks for it (`--progress json`, or TRAINLIFT_PROGRESS=json, which
`submit` sets in the job's environment so that `submit --follow` can draw its bar), one `trainlift-progress {json}`
line per progress post.
"""

from __future__ import annotations

import json
import re
import sys
import time
from typing import Callable, TextIO

from trainlift.progress_lines import PROGRESS_PREFIX

PROGRESS_KEYS = ("step", "total_steps", "loss", "tokens_per_s", "step_time_s")
REWARD_KEYS = ("rewards/accuracy", "rewards/margin")  # a DPO step's; in its json lines only when the row has them
# The latest evaluation, carried by the steps after it (a DPO run's eval rewards too); likewise only when present.
EVAL_KEYS = ("eval_step", "eval_loss", "eval_rewards/accuracy", "eval_rewards/margin")
MODES = ("auto", "json", "lines")
OWN_PREFIX = "trainlift:"  # what the recipe's workers print for the user (ops/ray_output.OWN_PREFIX)
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# A library's progress bar as it lands in a log ("Writing model shards: 100%|██████| 1/1 [00:00<00:00, 5.1it/s]").
_BAR = re.compile(r"\d+%\|.*\|\s*\d+/\d+|\r")


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def param_count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,d}"


def trainable_note(row: dict) -> str:
    """', 1.16M of 23.87M params trainable' for a start row that counts them (LoRA), else ''."""
    if not row.get("total_params"):
        return ""
    return f", {param_count(row['trainable_params'])} of {param_count(row['total_params'])} params trainable"


def mesh_note(row: dict) -> str:
    """', mesh 2 × 4 (replicate × shard: shard within a node, replicate across nodes)' for a start row with a mesh."""
    mesh = row.get("mesh")
    if not mesh:
        return ""
    why = f": {mesh['why']}" if mesh.get("why") else ""
    return f", mesh {mesh['replicate']} × {mesh['shard']} (replicate × shard{why})"


def step_figures(row: dict) -> str:
    """'loss 0.2349  4066 tok/s'; a DPO step's also 'reward acc 98%  margin 1.410' after its loss, and after an
    evaluation 'eval 0.3120 at 50' (a DPO run's 'eval 0.3120 at 50, reward acc 100%')."""
    parts = [f"loss {row['loss']:.4f}"]
    if row.get("rewards/accuracy") is not None:
        parts += [f"reward acc {row['rewards/accuracy']:.0%}", f"margin {row['rewards/margin']:.3f}"]
    if row.get("eval_loss") is not None:
        rewards = row.get("eval_rewards/accuracy")
        parts.append(f"eval {row['eval_loss']:.4f} at {row['eval_step']}"
                     + (f", reward acc {rewards:.0%}" if rewards is not None else ""))
    return "  ".join([*parts, f"{row['tokens_per_s']:.0f} tok/s"])


def human_line(row: dict, eta_s: float | None) -> str:
    total = row.get("total_steps")
    parts = [f"step {row['step']}/{total}" if total else f"step {row['step']}", step_figures(row)]
    if eta_s is not None:
        parts.append(f"ETA {duration(eta_s)}")
    return "  ".join(parts)


def start_line(row: dict) -> str:
    """'started on 2 workers, mesh …, attention sdpa, …': what a (re)start of the training loop runs on."""
    note = f"resumed at step {row['step']}" if row.get("resumed_from") else "started"
    attention = f", attention {row['attention']}" if row.get("attention") else ""
    return f"{note} on {row['world']} workers{mesh_note(row)}{attention}{trainable_note(row)}"


class Eta:
    """Seconds left, from the wall time per step measured after the first WARMUP_STEPS steps of a (re)start: those
    carry compilation and warm-up, and a resumed run's count starts at its checkpoint, not at 0. Wall time, not
    the step time alone, so evaluations and checkpoints are counted too."""

    WARMUP_STEPS = 2

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.start_step: int | None = None
        self.base: tuple[float, int] | None = None  # (time, step) once warm-up is over

    def restarted(self, step: int) -> None:
        self.start_step, self.base = step, None

    def __call__(self, row: dict) -> float | None:
        now, step, total = self.clock(), row["step"], row.get("total_steps")
        if self.start_step is None:
            self.start_step = step - 1
        if self.base is None:
            if step >= self.start_step + self.WARMUP_STEPS:
                self.base = (now, step)
            return None
        if not total or step <= self.base[1]:
            return None
        return (total - step) * (now - self.base[0]) / (step - self.base[1])


class ProgressLines:
    """Called with each row the driver reads off the progress board; prints lines to `out`."""

    def __init__(self, mode: str, every_s: float, out: TextIO = sys.stderr,
                 clock: Callable[[], float] = time.monotonic):
        self.mode, self.every_s, self.out, self.clock = mode, every_s, out, clock
        self.last_step: tuple | None = None  # (step, eval_step): a step posted again with its evaluation prints again
        self.last_start: tuple | None = None
        self.next_line_at = 0.0
        self.eta = Eta(clock)

    def __call__(self, row: dict) -> None:
        event = row.get("event")
        if event == "note":
            self._print(row["text"])
        if event == "start" and (row["step"], row.get("time")) != self.last_start:
            self.last_start = (row["step"], row.get("time"))  # the board repeats its latest row until the next
            self.eta.restarted(row["step"])
            if self.mode != "json":
                self._print(start_line(row))
        if event != "step" or (row["step"], row.get("eval_step")) == self.last_step:
            return
        self.last_step = (row["step"], row.get("eval_step"))
        if self.mode == "json":
            figures = {**{k: row.get(k) for k in PROGRESS_KEYS},
                       **{k: row[k] for k in REWARD_KEYS + EVAL_KEYS if k in row}}
            self._print(PROGRESS_PREFIX + json.dumps(figures))
            return
        eta = self.eta(row)
        now = self.clock()
        if now < self.next_line_at and row["step"] != row.get("total_steps"):
            return
        self.next_line_at = now + self.every_s
        self._print(human_line(row, eta))

    def _print(self, line: str) -> None:
        print(line, file=self.out, flush=True)


class JobLogLines:
    """A submitted job's log as a person reads it: the lines `trainlift train` prints without a terminal. Each
    `trainlift-progress {json}` line becomes a step line (every STRIDE-th of the run's steps, each new evaluation,
    the last step; ETA from the step time), trainlift's own lines stay (a worker's `trainlift: …` without Ray's
    prefix), and what Ray and the libraries print (the autoscaler, the raylet, Ray's log records, the workers'
    other lines, progress bars) is left out: `jobs logs --raw` has the log byte for byte."""

    LINES_PER_RUN = 20

    def __init__(self, parse: Callable[[str], dict | None], is_ray_line: Callable[[str], bool]):
        self.parse, self.is_ray_line = parse, is_ray_line
        self.last: dict | None = None  # the latest progress row, printed or not
        self.printed: tuple | None = None  # (step, eval_step) of the last printed row

    def __call__(self, line: str) -> list[str]:
        """What to print for one line of the log (often nothing)."""
        row = self.parse(line)
        if row is not None:
            return self._progress(row)
        text = _ANSI.sub("", line).rstrip()
        if not text.strip() or _BAR.search(text):
            return []
        if self.is_ray_line(text):
            own = text.split(") ", 1)[1] if ") " in text else ""
            return [own] if own.startswith(OWN_PREFIX) else []
        return [text]

    def flush(self) -> list[str]:
        """The last progress row, if it was not printed (a log that ends mid-run)."""
        return self._line(self.last) if self.last is not None and self._key(self.last) != self.printed else []

    def _progress(self, row: dict) -> list[str]:
        if row.get("step") is None or row.get("loss") is None:
            return []
        previous, self.last = self.last, row
        total = row.get("total_steps") or 0
        stride = max(1, total // self.LINES_PER_RUN)
        new_eval = previous is not None and row.get("eval_step") != previous.get("eval_step")
        crossed = previous is None or row["step"] // stride != previous["step"] // stride
        if self._key(row) == self.printed or not (crossed or new_eval or row["step"] == total):
            return []
        return self._line(row)

    def _line(self, row: dict) -> list[str]:
        self.printed = self._key(row)
        total, step_time = row.get("total_steps"), row.get("step_time_s")
        eta = (total - row["step"]) * step_time if total and step_time and row["step"] < total else None
        return [human_line({"tokens_per_s": 0.0, **{k: v for k, v in row.items() if v is not None}}, eta)]

    @staticmethod
    def _key(row: dict) -> tuple:
        return row.get("step"), row.get("eval_step")
