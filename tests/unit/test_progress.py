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
