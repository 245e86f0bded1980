"""A run trained on past the steps its schedule was planned for goes on as `train.schedule_extension` says, says so
before it trains, and its checkpoint carries the schedule it trained on. Values worked by hand from the published
warmup-cosine formula (cos(pi/4) = 0.70710678, cos(pi/10) = 0.95105652, cos(0.8 pi) = -0.80901699), not by the code under test."""

from __future__ import annotations

import json

import pytest
import torch

from trainlift.config.job import load_job_spec
from trainlift.train.run import schedule
from trainlift.train.recipe import extend_schedule
from trainlift.train.run.schedule import lr_lambda


def test_constant_goes_on_at_the_floor_after_the_planned_end_and_finishes_the_plan_first():
    planned = lr_lambda(warmup=0, total=10, min_ratio=0.1)
    finished = planned.extended(20, "constant", at_step=10, warmup=0)
    assert [finished(s) for s in (10, 15, 19)] == pytest.approx([0.1, 0.1, 0.1])
    stopped = planned.extended(20, "constant", at_step=5, warmup=0)  # stopped at 5 of 10, given 20
    assert [stopped(s) for s in (5, 10, 15)] == pytest.approx([0.55, 0.1, 0.1])


def test_restart_warms_up_and_decays_again_over_the_steps_left():
    planned = lr_lambda(warmup=0, total=10, min_ratio=0.1)
    restarted = planned.extended(30, "restart", at_step=10, warmup=4)
    assert [restarted(s) for s in (5, 10, 11, 13, 14, 30)] == pytest.approx([0.55, 0.2, 0.4, 0.8, 1.0, 0.1])
    assert restarted(22) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the new cosine (14..30)
    mid = planned.extended(30, "restart", at_step=6, warmup=0)  # the old phase ends where the new one starts
    assert [mid(s) for s in (5, 6, 18)] == pytest.approx([0.55, 1.0, 0.55])


def test_stretch_recomputes_the_cosine_over_the_new_total_and_jumps_back_up():
    planned = lr_lambda(warmup=0, total=10, min_ratio=0.1)
    stretched = planned.extended(20, "stretch", at_step=10, warmup=0)
    assert [stretched(s) for s in (5, 10, 20)] == pytest.approx([0.1 + 0.9 * 0.5 * (1 + 0.70710678), 0.55, 0.1])


def test_the_planned_total_changes_nothing_and_the_schedule_survives_the_checkpoint_json():
    planned = lr_lambda(warmup=2, total=10, min_ratio=0.1).extended(20, "restart", at_step=10, warmup=3)
    for how in schedule.EXTENSIONS:
        assert planned.extended(20, how, at_step=12, warmup=5).phases == planned.phases
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    state = json.loads(json.dumps(torch.optim.lr_scheduler.LambdaLR(optimizer, planned).state_dict()))
    restored = schedule.from_state(state["lr_lambdas"][0])
    assert restored.phases == planned.phases and [restored(s) for s in range(25)] == [planned(s) for s in range(25)]
    assert schedule.from_state(None) is None  # a checkpoint from before schedules were saved


def test_a_resumed_scheduler_sets_the_lr_of_its_step_under_the_chosen_extension():
    """The optimizer's LR restored from the checkpoint is the old schedule's; the resumed step must use the new."""
    spec = load_job_spec("examples/tiny-local.yaml", ["train.steps=20", "train.warmup_steps=0", "train.lr=1.0",
                                                      "train.min_lr_ratio=0.1", "train.schedule_extension=restart"])
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(0, 10, 0.1))
    for _ in range(10):
        optimizer.step()
        scheduler.step()
    saved = json.loads(json.dumps(scheduler.state_dict()))
    resumed_optimizer = torch.optim.SGD([param], lr=1.0)
    resumed_optimizer.param_groups[0]["lr"] = optimizer.param_groups[0]["lr"]  # as the optimizer state restores it
    resumed = torch.optim.lr_scheduler.LambdaLR(resumed_optimizer, lr_lambda(0, 20, 0.1))
    resumed.load_state_dict(saved)
    extend_schedule(resumed, spec.train, step=10)
    assert resumed_optimizer.param_groups[0]["lr"] == pytest.approx(1.0) and resumed.get_last_lr() == [
        pytest.approx(1.0)]
    resumed_optimizer.step()
    resumed.step()
    assert resumed_optimizer.param_groups[0]["lr"] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + 0.95105652))  # cos(pi/10)


def test_the_note_says_what_happens_to_the_lr_and_names_the_other_choices():
    planned = lr_lambda(warmup=0, total=400, min_ratio=0.1)
    note = schedule.extension_note("tiny-demo", planned, 500, 400, "constant", 10, 3e-3)
    assert note == ("run tiny-demo was planned for 400 steps and now trains to 500 from step 400: the LR stays at "
                    "its final 0.0003 (train.schedule_extension=constant; restart: a new 10-step warmup and cosine "
                    "over steps 400-500 (LR 0.000273 at first); stretch: the cosine spans all 500 steps (LR 0.0003 "
                    "→ 0.000558 at step 400))")
    assert schedule.extension_note("tiny-demo", planned, 400, 300, "constant", 10, 3e-3) is None


def test_a_stopped_run_given_more_steps_is_told_its_plan_runs_to_its_end_first():
    planned = lr_lambda(warmup=0, total=400, min_ratio=0.1)
    note = schedule.extension_note("tiny-demo", planned, 500, 300, "constant", 10, 3e-3)
    assert note.startswith("run tiny-demo was planned for 400 steps and now trains to 500 from step 300: the planned "
                           "schedule runs to step 400, then the LR stays at its final 0.0003 (")


def test_a_second_restart_at_the_same_step_replaces_the_first_in_what_the_checkpoint_keeps():
    once = lr_lambda(warmup=0, total=10, min_ratio=0.1).extended(20, "restart", at_step=10, warmup=2)
    again = once.extended(30, "restart", at_step=10, warmup=2)  # stopped before its first new step, given more
    assert again.phases == [{"start": 0, "end": 10, "warmup": 0}, {"start": 10, "end": 30, "warmup": 2}]
