"""The learning-rate schedule, as LambdaLR's factor of `train.lr`: a linear warmup, then the cosine down to
`train.min_lr_ratio`, and the floor after the planned steps. A run resumed with another `train.steps` than its
schedule was planned for (a finished run trained on, a stopped one given more steps) goes on as
`train.schedule_extension` says:

- constant: the planned schedule runs to its end, then the LR stays at its final value (the floor);
- restart: from the step it resumes at, a new warmup and cosine over the steps left;
- stretch: the cosine is recomputed over the new total, as if it had been planned so (the LR jumps back up).

The schedule is a callable object, so LambdaLR saves its phases with the scheduler's state: a checkpoint knows the
schedule it trained on. Pure: no torch.
"""

from __future__ import annotations

import math
from typing import Literal

Extension = Literal["constant", "restart", "stretch"]
EXTENSIONS: tuple[Extension, ...] = ("constant", "restart", "stretch")


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Warmup (step + 1) / (warmup + 1), then min_ratio + (1 - min_ratio) * 0.5 * (1 + cos(pi * progress)) with
    progress = (step - warmup) / (total - warmup), held at the floor past `total`."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class Schedule:
    """Phases, each {"start", "end", "warmup"}: a warmup and cosine over [start, end), in the order they began; a
    step is in the last phase that started at or before it."""

    def __init__(self, min_ratio: float, phases: list[dict]):
        self.min_ratio = min_ratio
        self.phases = [dict(p) for p in phases]

    def __call__(self, step: int) -> float:
        phase = [p for p in self.phases if p["start"] <= step][-1]
        start = phase["start"]
        return warmup_cosine(step - start, phase["warmup"], phase["end"] - start, self.min_ratio)

    @property
    def planned_steps(self) -> int:
        return self.phases[-1]["end"]

    def extended(self, total: int, how: Extension, at_step: int, warmup: int) -> "Schedule":
        """This schedule for a run resumed at `at_step` to train to `total` steps (itself when that is its plan)."""
        out = Schedule(self.min_ratio, self.phases)
        if total == self.planned_steps:
            return out
        if how == "stretch":
            out.phases[-1]["end"] = total
        elif how == "restart":
            out.phases = [p for p in out.phases if p["start"] < at_step]
            out.phases.append({"start": at_step, "end": total, "warmup": warmup})
        return out


def lr_lambda(warmup: int, total: int, min_ratio: float) -> Schedule:
    """The schedule a run plans at its first start: one warmup and cosine over all its steps."""
    return Schedule(min_ratio, [{"start": 0, "end": total, "warmup": warmup}])


def from_state(state: dict | None) -> Schedule | None:
    """The schedule a checkpoint's scheduler state holds (None: written before schedules were saved)."""
    if not isinstance(state, dict) or "phases" not in state:
        return None
    return Schedule(float(state["min_ratio"]), state["phases"])


def extension_note(run: str, planned: Schedule, total: int, at_step: int, how: Extension, warmup: int,
                   lr: float) -> str | None:
    """What happens to the LR of a run resumed at `at_step` with `total` steps, said before it trains; None when the
    schedule goes on as planned."""
    if total == planned.planned_steps:
        return None
    now = planned(at_step) * lr
    after = {how_: planned.extended(total, how_, at_step, warmup)(at_step) * lr for how_ in EXTENSIONS}
    said = {
        "constant": (f"the planned schedule runs to step {planned.planned_steps}, then the LR stays at its final "
                     f"{planned.min_ratio * lr:.3g}" if at_step < planned.planned_steps
                     else f"the LR stays at its final {after['constant']:.3g}"),
        "restart": f"a new {warmup}-step warmup and cosine over steps {at_step}-{total} (LR {after['restart']:.3g} "
                   "at first)",
        "stretch": f"the cosine spans all {total} steps (LR {now:.3g} → {after['stretch']:.3g} at step {at_step})",
    }
    others = "; ".join(f"{name}: {said[name]}" for name in EXTENSIONS if name != how)
    return (f"run {run} was planned for {planned.planned_steps} steps and now trains to {total} from step {at_step}: "
            f"{said[how]} (train.schedule_extension={how}; {others})")
