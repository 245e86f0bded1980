"""Where a run's numbers go, on each worker: rank 0's metrics.jsonl and trackers, the driver's progress board, and
the throughput of the steps since the (re)start. `w` is the recipe's `Worker`; a step's `result` its `StepResult`."""

from __future__ import annotations

import time
from typing import Any

from trainlift.train.model.build import StepFlops
from trainlift.train.run import metrics, trackers

BOARD_POST_INTERVAL_S = 0.5  # the driver reads the board this often; posting every step only costs CPU


class RunLog:
    """Where the run's numbers go: metrics.jsonl and the trackers (rank 0), the driver's progress board (at most
    every BOARD_POST_INTERVAL_S), and the throughput over the steps after the first one of this (re)start."""

    def __init__(self, w, board, step: int, fpt: StepFlops):
        self.w, self.fpt, self.first_step = w, fpt, step
        self.board = board if w.rank == 0 else None
        self.sink = trackers.open_sink(w.spec, w.fs, w.run_path, step) if w.rank == 0 else metrics.NullSink()
        self.peak = metrics.device_peak_flops(w.device)
        self.timed_tokens, self.timed_flops, self.timed_seconds, self.post_at = 0.0, 0.0, 0.0, 0.0
        self.timed_hardware_flops = 0.0
        self.held_s: list[float] = []  # per checkpoint, how long it held the loop
        self.last_eval: dict[str, Any] = {}  # the latest evaluation, posted with the steps after it
        self.last_posted: dict[str, Any] | None = None  # the latest step row on the board

    def started(self, step: int, resumed_from: str | None, facts: dict[str, Any]) -> dict:
        row = {"event": "start", "step": step, "total_steps": self.w.spec.train.steps, "resumed_from": resumed_from,
               "world": self.w.world, "time": time.time(), **facts}
        self.sink.write(row)  # marks the (re)start for `trainlift report`
        return row

    def post(self, row: dict) -> None:
        if self.board is not None:
            self.board.update.remote(row)

    def evaluated(self, step: int, loss: float, figures: dict[str, float]) -> None:
        """An evaluation at `step`: to metrics.jsonl, and to the board with every step posted until the next one."""
        self.sink.write({"step": step, "eval_loss": loss, **figures, "time": time.time()})
        self.last_eval = {"eval_step": step, "eval_loss": loss,
                          **{k: v for k, v in figures.items() if k.startswith("eval_rewards/")}}
        # An evaluation of the step last posted (the final one comes after the last step): posted again with it,
        # so the last progress line shows the evaluation the summary has.
        if self.last_posted is not None and self.last_posted["step"] == step:
            self.post({**self.last_posted, **self.last_eval})

    def stepped(self, step: int, result, lr: float, step_time: float, last: bool) -> None:
        tokens = result.tokens
        attended = result.attended / max(tokens, 1.0)
        fpt, hardware = self.fpt.per_token(attended), self.fpt.hardware_per_token(attended)
        if step > self.first_step + 1:  # the first step after (re)start carries warm-up costs
            self.timed_tokens, self.timed_seconds = self.timed_tokens + tokens, self.timed_seconds + step_time
            self.timed_flops += tokens * fpt
            self.timed_hardware_flops += tokens * hardware
        per_device = tokens / step_time / self.w.world
        row = {"step": step, "loss": result.loss, "lr": lr, "grad_norm": result.grad_norm, "world": self.w.world,
               "tokens": tokens, "tokens_per_s": tokens / step_time, "step_time_s": step_time, "flops_per_token": fpt,
               "mfu": metrics.mfu(per_device, fpt, self.peak), "hfu": metrics.mfu(per_device, hardware, self.peak),
               **(result.metrics or {}), "time": time.time()}
        self.sink.write(row)
        if last or time.monotonic() >= self.post_at:
            self.last_posted = {"event": "step", **row, **self.last_eval, "total_steps": self.w.spec.train.steps}
            self.post(self.last_posted)
            self.post_at = time.monotonic() + BOARD_POST_INTERVAL_S

    def checkpoint_held(self, step: int, seconds: float) -> None:
        """A checkpoint of `step` held the loop `seconds` (all of the save when sync; the copy to host when async)."""
        self.held_s.append(seconds)
        self.sink.write({"event": "checkpoint", "step": step, "checkpoint_blocked_s": seconds, "time": time.time()})

    def throughput(self, step: int) -> dict:
        tokens_per_s = self.timed_tokens / self.timed_seconds if self.timed_seconds else None
        fpt = self.timed_flops / self.timed_tokens if self.timed_tokens else None
        hardware = self.timed_hardware_flops / self.timed_tokens if self.timed_tokens else None
        return {"tokens_per_s": tokens_per_s,
                "step_time_s": self.timed_seconds / max(1, step - self.first_step - 1) if self.timed_seconds else None,
                "mfu": metrics.mfu(tokens_per_s / self.w.world, fpt, self.peak) if tokens_per_s else None,
                "hfu": metrics.mfu(tokens_per_s / self.w.world, hardware, self.peak) if tokens_per_s else None,
                "flops_per_token": fpt,
                "checkpoint_blocked_s": sum(self.held_s) / len(self.held_s) if self.held_s else None}

    def close(self, summary: dict) -> None:
        self.sink.close(summary)
        if self.board is not None:
            import ray

            ray.get(self.board.finish.remote(summary))
