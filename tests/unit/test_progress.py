"""`trainlift train`'s progress lines off a terminal, and the switch `submit` sets for `--follow`."""

import io

from trainlift.cli.progress import ProgressLines
from trainlift.ops import jobs


def step(n, total=10):
    return {"event": "step", "step": n, "total_steps": total, "loss": 2.0 / n, "tokens_per_s": 1234.4,
            "step_time_s": 0.1, "lr": 1e-3, "time": 0.0}


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_json_mode_prints_one_machine_line_per_new_step_that_follow_parses():
    out = io.StringIO()
    lines = ProgressLines("json", 30, out=out)
    for row in ({"event": "start", "step": 0, "world": 2, "time": 1.0}, step(1), step(1), step(2)):
        lines(row)
    parsed = [jobs.parse_progress(line) for line in out.getvalue().splitlines()]
    assert [p["step"] for p in parsed] == [1, 2] and parsed[0]["total_steps"] == 10


def test_lines_mode_prints_a_human_line_every_n_seconds_with_an_eta():
    out, clock = io.StringIO(), Clock()
    lines = ProgressLines("lines", 30, out=out, clock=clock)
    start = {"event": "start", "step": 0, "world": 2, "resumed_from": None, "time": 5.0}
    lines(start)
    lines(start)  # the board repeats its latest row: printed once
    for n in range(1, 11):
        clock.now += 10  # 10 s per step
        lines(step(n))
    printed = out.getvalue().splitlines()
    assert printed[0] == "started on 2 workers"
    assert printed[1] == "step 1/10  loss 2.0000  1234 tok/s"
    assert printed[2] == "step 4/10  loss 0.5000  1234 tok/s  ETA 1m00s"
    assert printed[-1].startswith("step 10/10") and len(printed) == 5  # start, steps 1, 4, 7, 10
    assert not any(line.startswith(jobs.PROGRESS_PREFIX) for line in printed)


def test_the_start_line_counts_trainable_parameters_when_the_row_has_them():
    out = io.StringIO()
    lines = ProgressLines("lines", 30, out=out, clock=Clock())
    lines({"event": "start", "step": 3, "world": 1, "resumed_from": "r/checkpoint_00000003", "time": 1.0,
           "trainable_params": 1_163_264, "total_params": 23_866_880})
    assert out.getvalue() == "resumed at step 3 on 1 workers, 1.16M of 23.87M params trainable\n"


def test_a_submitted_job_asks_for_machine_lines(tmp_path):
    env = jobs.runtime_env(tmp_path, [], [], {"HF_HOME": "/data"})
    assert env["env_vars"][jobs.PROGRESS_ENV] == "json" and env["env_vars"]["HF_HOME"] == "/data"


def test_an_unknown_progress_mode_is_a_usage_error(tmp_path):
    from typer.testing import CliRunner

    from trainlift.cli import app
    from trainlift.errors import UsageError

    result = CliRunner().invoke(app, ["train", str(tmp_path / "job.yaml")], env={jobs.PROGRESS_ENV: "fancy"})
    assert isinstance(result.exception, UsageError) and result.exception.exit_code == 2
    assert "--progress 'fancy'" in result.exception.one_line() and "TRAINLIFT_PROGRESS" in result.exception.one_line()


def test_the_eta_leaves_out_warm_up_and_counts_from_a_resumed_step():
    """Step 1 took 60 s (compilation), then 2 s a step: at step 29 of 200 the ETA is 171 × 2 s, not the
    0:00:06 a bar that averaged from step 0 of a resumed count showed."""
    from trainlift.cli.progress import Eta

    clock = Clock()
    eta = Eta(clock)
    eta.restarted(0)
    clock.now += 60
    assert eta(step(1, 200)) is None
    for n in range(2, 30):
        clock.now += 2
        left = eta(step(n, 200))
    assert left == (200 - 29) * 2.0
    eta.restarted(150)  # resumed at 150: its rate is measured again, not carried over from 0
    clock.now += 30
    assert eta(step(151, 200)) is None and eta(step(152, 200)) is None
    clock.now += 4
    assert eta(step(154, 200)) == (200 - 154) * 2.0


def test_on_a_terminal_the_start_line_and_notes_stay_above_the_bar(monkeypatch):
    from rich.console import Console

    from trainlift.cli import train as train_cli
    from trainlift.config.job import load_job_spec

    terminal = Console(record=True, force_terminal=True, width=120, file=io.StringIO())
    monkeypatch.setattr(train_cli, "console", terminal)
    job = load_job_spec("examples/tiny-local.yaml", ["train.steps=10"])
    with train_cli._progress_display(job, "auto", 30, hidden=False) as on_update:
        on_update({"event": "note", "text": "Ray: starting an embedded local Ray in this process"})
        start = {"event": "start", "step": 0, "world": 2, "resumed_from": None, "time": 5.0, "attention": "sdpa"}
        on_update(start)
        on_update(start)
        for n in range(1, 11):
            on_update(step(n))
    text = terminal.export_text()
    assert text.count("started on 2 workers, attention sdpa\n") == 1
    assert text.index("Ray: starting") < text.index("started on 2 workers") < text.rindex("10/10")
    assert "ETA " in text


def dpo_step(n, total=10, accuracy=0.75, margin=0.4):
    """A DPO step's board row, keys as the recipe posts them."""
    return {**step(n, total), "grad_norm": 1.2, "world": 2, "tokens": 1658.0, "flops_per_token": 5.1e6, "mfu": None,
            "rewards/chosen": -0.27, "rewards/rejected": -0.27 - margin, "rewards/margin": margin,
            "rewards/accuracy": accuracy}


def test_a_dpo_step_shows_its_reward_accuracy_and_margin_next_to_the_loss():
    out, clock = io.StringIO(), Clock()
    lines = ProgressLines("lines", 0, out=out, clock=clock)
    lines({"event": "start", "step": 0, "world": 2, "resumed_from": None, "time": 5.0, "objective": "dpo"})
    lines(dpo_step(1, accuracy=0.0, margin=0.0))
    lines(dpo_step(2, accuracy=0.984, margin=1.41018))
    printed = out.getvalue().splitlines()
    assert printed[1] == "step 1/10  loss 2.0000  reward acc 0%  margin 0.000  1234 tok/s"
    assert printed[2] == "step 2/10  loss 1.0000  reward acc 98%  margin 1.410  1234 tok/s"


def test_json_lines_carry_a_dpo_steps_rewards_and_nothing_new_for_sft():
    out = io.StringIO()
    lines = ProgressLines("json", 30, out=out)
    lines(step(1))
    lines(dpo_step(2, accuracy=1.0, margin=0.5))
    sft, dpo = [jobs.parse_progress(line) for line in out.getvalue().splitlines()]
    assert set(sft) == {"step", "total_steps", "loss", "tokens_per_s", "step_time_s"}
    assert (dpo["rewards/accuracy"], dpo["rewards/margin"]) == (1.0, 0.5) and "rewards/chosen" not in dpo


def summary_text(monkeypatch, summary):
    from rich.console import Console

    from trainlift.cli import train as train_cli

    terminal = Console(record=True, width=120, file=io.StringIO())
    monkeypatch.setattr(train_cli, "console", terminal)
    train_cli._summary_table({"name": "demo", "run": "runs/demo", "steps": 6, "final_loss": 0.2349,
                              "eval_loss": 0.1909, "tokens_per_s": 3872.0, **summary}, json_out=False)
    return terminal.export_text()


def test_the_final_table_of_a_dpo_run_shows_its_eval_reward_accuracy_and_an_sft_one_does_not(monkeypatch):
    dpo = summary_text(monkeypatch, {"objective": "dpo", "eval_rewards/accuracy": 0.9666, "eval_rewards/margin": 1.6686,
                                     "eval_rewards/chosen": -0.2187, "eval_rewards/rejected": -1.8872})
    rows = [line.split("│")[1:3] for line in dpo.splitlines() if line.count("│") == 3]
    keys = [key.strip() for key, _ in rows]
    assert keys.index("eval_loss") + 1 == keys.index("eval_rewards/accuracy")
    assert dict((k.strip(), v.strip()) for k, v in rows)["eval_rewards/accuracy"] == "96.7%"
    assert dict((k.strip(), v.strip()) for k, v in rows)["eval_rewards/margin"] == "1.669"
    sft = summary_text(monkeypatch, {"objective": "sft"})
    assert "rewards" not in sft and "eval_loss" in sft
    assert summary_text(monkeypatch, {"objective": "dpo"}).count("rewards") == 0  # no eval data: no eval rewards


def test_on_a_terminal_the_bar_of_a_dpo_run_shows_the_same_figures_as_its_lines(monkeypatch):
    from rich.console import Console

    from trainlift.cli import train as train_cli
    from trainlift.config.job import load_job_spec

    terminal = Console(record=True, force_terminal=True, width=160, file=io.StringIO())
    monkeypatch.setattr(train_cli, "console", terminal)
    job = load_job_spec("examples/tiny-local-dpo.yaml", ["train.steps=10"])
    with train_cli._progress_display(job, "auto", 30, hidden=False) as on_update:
        on_update({"event": "start", "step": 0, "world": 2, "resumed_from": None, "time": 5.0})
        for n in range(1, 11):
            on_update(dpo_step(n, accuracy=0.9, margin=1.25))
    assert "loss 0.2000  reward acc 90%  margin 1.250  1234 tok/s" in terminal.export_text()


def test_the_latest_evaluation_rides_with_the_steps_after_it_in_lines_and_json():
    """RunLog keeps the latest evaluation and posts it with every step until the next one; the human line shows it
    after the loss, and the json line `submit --follow` parses carries it (a DPO run's eval reward accuracy too)."""
    from types import SimpleNamespace

    from trainlift.train.run.runlog import RunLog

    posted = []
    board = SimpleNamespace(update=SimpleNamespace(remote=posted.append))
    worker = SimpleNamespace(rank=1, world=2, device=SimpleNamespace(type="cpu"),
                             spec=SimpleNamespace(train=SimpleNamespace(steps=10)))
    flops = SimpleNamespace(per_token=lambda attended: 1e6, hardware_per_token=lambda attended: 1e6)
    log = RunLog(worker, None, 0, flops)
    log.board = board  # rank 0's role without its metrics file
    result = SimpleNamespace(tokens=100.0, attended=100.0, loss=0.5, grad_norm=1.0, metrics={})
    log.stepped(1, result, 1e-3, 0.1, last=True)
    log.evaluated(1, 0.41234, {"eval_rewards/accuracy": 0.95, "eval_rewards/margin": 1.5, "eval_rewards/chosen": -0.1})
    log.stepped(2, result, 1e-3, 0.1, last=True)
    log.evaluated(2, 0.3, {})
    log.stepped(3, result, 1e-3, 0.1, last=True)
    # An evaluation of the step last posted posts that step again with it (the final one's line shows it).
    assert [(r["step"], r.get("eval_step")) for r in posted] == [(1, None), (1, 1), (2, 1), (2, 2), (3, 2)]
    posted = posted[0:1] + posted[2:3] + posted[4:]  # the steps as they were posted after each evaluation
    assert "eval_loss" not in posted[0]
    assert (posted[1]["eval_step"], posted[1]["eval_loss"], posted[1]["eval_rewards/accuracy"]) == (1, 0.41234, 0.95)
    assert (posted[2]["eval_step"], posted[2]["eval_loss"]) == (2, 0.3) and "eval_rewards/accuracy" not in posted[2]

    out = io.StringIO()
    lines = ProgressLines("lines", 0, out=out, clock=Clock())
    for row in posted:
        lines(row)
    printed = out.getvalue().splitlines()
    assert printed[0] == "step 1/10  loss 0.5000  1000 tok/s"
    assert printed[1] == "step 2/10  loss 0.5000  eval 0.4123 at 1, reward acc 95%  1000 tok/s"
    assert printed[2].startswith("step 3/10  loss 0.5000  eval 0.3000 at 2  1000 tok/s")

    out = io.StringIO()
    lines = ProgressLines("json", 30, out=out)
    for row in posted:
        lines(row)
    parsed = [jobs.parse_progress(line) for line in out.getvalue().splitlines()]
    assert "eval_loss" not in parsed[0]
    assert (parsed[1]["eval_loss"], parsed[1]["eval_step"], parsed[1]["eval_rewards/accuracy"]) == (0.41234, 1, 0.95)
    assert "eval_rewards/chosen" not in parsed[1]
