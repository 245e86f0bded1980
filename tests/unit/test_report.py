"""The run report's pure part (rows -> restarts, figures, HTML) and reading run directories."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainlift import report, rundir
from trainlift.errors import UsageError


def start(step, world=2, t=0.0, resumed=None):
    return {"event": "start", "step": step, "total_steps": 6, "world": world, "resumed_from": resumed, "time": t}


def train(step, world=2, loss=1.0, mfu=None):
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "world": world, "tokens": 10,
            "tokens_per_s": 100.0, "step_time_s": 0.1, "mfu": mfu, "time": float(step)}


def test_restarts_tell_a_resume_a_restart_and_a_resize_apart():
    resumed = [start(0), train(1), train(2), start(2, resumed="ck2"), train(3)]
    assert [(m.step, m.label) for m in report.restarts(resumed)] == [(2, "resumed at 2")]
    failed = [start(0), train(1), train(2), train(3), start(2, resumed="ck2"), train(3)]
    assert [(m.step, m.label) for m in report.restarts(failed)] == [(2, "restarted from 2")]
    resized = [start(0, world=4), train(1, 4), train(2, 4), train(3, 4), start(2, world=3), train(3, 3)]
    assert [(m.step, m.label) for m in report.restarts(resized)] == [(2, "4→3 workers at 2")]
    assert report.restarts([start(0), train(1), train(2)]) == []


def test_restarts_in_files_without_start_rows_come_from_the_steps():
    rows = [train(1), train(2), train(3), train(2), train(3), train(4, world=1)]
    assert [(m.step, m.label) for m in report.restarts(rows)] == [(1, "restarted from 1"), (3, "2→1 workers at 3")]


def test_build_draws_the_plots_that_have_data_into_one_self_contained_page():
    rows = [start(0), {"step": 0, "eval_loss": 2.0, "time": 0.0}, *[train(s, loss=2.0 / s) for s in (1, 2, 3)],
            {"step": 3, "eval_loss": 1.0, "time": 3.0}]
    page, pngs = report.build([("demo", rows, {"finished": True, "steps": 3, "final_loss": 0.667, "mfu": None})])
    assert list(pngs) == ["loss", "lr", "tokens_per_s"]  # every MFU is None: no empty MFU plot
    assert all(data.startswith(b"\x89PNG") and len(data) > 5000 for data in pngs.values())
    assert page.count("data:image/png;base64,") == 3 and "http" not in page.split("<body>", 1)[1]
    assert "<th>final_loss</th><td>0.6670</td>" in page and "<th>mfu</th><td>—</td>" in page
    resumed = {"finished": True, "initial_eval_loss": None, "resumed_from": "s3://b/runs/demo/checkpoint_00000002"}
    assert report.table_values(rows, resumed) == {"finished": True, "initial_eval_loss": 2.0,
                                                  "resumed_from": "checkpoint_00000002"}
    with_mfu = [start(0), train(1, mfu=0.31), train(2, mfu=0.33)]
    assert "mfu" in report.build([("gpu", with_mfu, None)])[1]


def test_compare_puts_every_run_in_the_table_and_the_plots():
    a = [start(0), train(1, loss=2.0), train(2, loss=1.5)]
    b = [start(0), train(1, loss=2.2), train(2, loss=1.9)]
    figs = report.figures([("a", a), ("b", b)])
    assert [line.get_label() for line in figs["loss"].axes[0].get_lines()] == ["a train", "b train"]
    page, _ = report.build([("a", a, {"steps": 2}), ("b", b, {"steps": 2})])
    assert "<th>a</th><th>b</th>" in page and "a vs b" in page


def test_a_run_without_steps_is_a_usage_error():
    with pytest.raises(UsageError, match="no training steps"):
        report.build([("empty", [start(0)], None)])


def write_run(root, name, rows, summary=None, checkpoints=(), complete=()):
    run = root / name
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9, "lo')
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    for step in checkpoints:
        (run / f"checkpoint_{step:08d}").mkdir()
        if step in complete:
            (run / f"checkpoint_{step:08d}" / "COMPLETE").write_text("")
    return run


def age(path, seconds):
    stamp = time.time() - seconds
    os.utime(path, (stamp, stamp))


def test_runs_listing_reads_steps_losses_and_state(tmp_path):
    rows = [start(0), train(1, loss=2.0), train(2, loss=1.5), {"step": 2, "eval_loss": 1.7, "time": 2.0}]
    done = write_run(tmp_path, "done", [*rows, train(3, loss=1.2)], {"finished": True, "steps": 3})
    stopped = write_run(tmp_path, "stopped", rows, {"finished": False, "steps": 2}, checkpoints=(2, 4), complete=(2,))
    crashed = write_run(tmp_path, "crashed", rows)
    live = write_run(tmp_path, "live", rows, checkpoints=(2,), complete=(2,))
    killed = write_run(tmp_path, "killed", [start(0), {"step": 0, "eval_loss": 3.0, "time": 0.5}, train(1, loss=2.0)],
                       checkpoints=(1,), complete=(1,))
    # A driver record names the process driving a run: this test's own (alive), and one that has exited.
    (live / "driver.json").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (killed / "driver.json").write_text(json.dumps({"host": socket.gethostname(), "pid": int(gone.stdout)}))
    (tmp_path / "not-a-run").mkdir()
    for run, seconds in ((done, 900), (stopped, 2000), (crashed, 4000), (live, 5), (killed, 10)):
        for f in run.iterdir():
            age(f, seconds)
    listing = {r["name"]: r for r in rundir.list_runs(str(tmp_path))}
    assert list(listing) == ["live", "killed", "done", "stopped", "crashed"]  # newest first, not-a-run left out
    assert {n: r["state"] for n, r in listing.items()} == {
        "done": "finished", "stopped": "checkpointed at step 2", "crashed": "no checkpoint", "live": "running",
        "killed": "checkpointed at step 1 (driver gone)"}
    assert (listing["done"]["steps"], listing["done"]["total_steps"], listing["done"]["loss"]) == (3, 6, 1.2)
    assert listing["stopped"]["eval_loss"] == 1.7 and 1990 < listing["stopped"]["age_s"] < 2100
    assert listing["killed"]["eval_loss"] is None  # it never evaluated after step 0


def test_runs_and_report_say_what_is_wrong_with_a_bad_path(tmp_path):
    from typer.testing import CliRunner

    from trainlift.cli import app

    missing = CliRunner().invoke(app, ["runs", str(tmp_path / "nope")])
    assert isinstance(missing.exception, UsageError) and missing.exception.exit_code == 2
    assert "no such directory" in missing.exception.one_line()
    (tmp_path / "plain").mkdir()
    not_run = CliRunner().invoke(app, ["report", str(tmp_path / "plain")])
    assert isinstance(not_run.exception, UsageError) and "not a trainlift run directory" in not_run.exception.one_line()


def test_a_report_lands_in_the_local_run_directory_not_the_working_one(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from trainlift.cli import app
    from trainlift.cli.report import default_output

    run = tmp_path / "runs" / "demo"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 2.0 / s, "lr": 1e-3, "time": s}) + "\n"
                                               for s in (1, 2, 3)))
    monkeypatch.chdir(tmp_path)
    done = CliRunner().invoke(app, ["report", "runs/demo"])
    assert done.exit_code == 0, done.output
    assert (run / "report.html").is_file() and not list(tmp_path.glob("*.html"))
    assert default_output("s3://bucket/runs/demo", "demo") == Path("demo-report.html")
    elsewhere = CliRunner().invoke(app, ["report", "runs/demo", "-o", "reports/new/demo.html"])  # a new directory
    assert elsewhere.exit_code == 0, elsewhere.output
    assert (tmp_path / "reports" / "new" / "demo.html").is_file()
