"""Trackers, the run report and the runs listing on one real run: a 4-step, 2-worker fit on the local Ray
cluster that stops at step 2 (checkpoint) and is resumed, logging to TensorBoard and to an MLflow file store
through the real libraries. The report is then opened the way a person would, in headless Chromium."""

import json
import os
import re
import shutil
import subprocess

import pytest

from trainlift.train.launch import run_training

pytestmark = pytest.mark.usefixtures("ray_local")
SCALAR_TAGS = {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "eval/loss"}


@pytest.fixture(scope="module")
def tracked_run(tiny_assets, tmp_path_factory):
    from trainlift.config.job import validate_job_spec

    root = tmp_path_factory.mktemp("observe")
    mlflow_uri = f"file://{root / 'mlruns'}"
    spec = validate_job_spec({
        "model": {"path": str(tiny_assets / "model")},
        "data": {"train": str(tiny_assets / "train.jsonl"), "eval": str(tiny_assets / "eval.jsonl"), "seq_len": 64,
                 "eval_examples": 8},
        "train": {"steps": 4, "micro_batch_size": 2, "lr": 1e-3, "warmup_steps": 1, "seed": 0},
        "checkpoint": {"every_steps": 2, "keep": 2},
        "run": {"name": "obs-run", "storage": str(root / "runs"), "max_failures": 0,
                "trackers": ["tensorboard", "mlflow"], "mlflow_uri": mlflow_uri},
    })
    previous = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # MLflow's file store is opt-in; the workers get it forwarded
    try:
        stopped = run_training(spec, stop_at_step=2)
        run_dir = root / "runs" / "obs-run"
        first_id = json.loads((run_dir / "mlflow.json").read_text())["run_id"]
        resumed = run_training(spec)
        yield {"stopped": stopped, "resumed": resumed, "run_dir": run_dir, "mlflow_uri": mlflow_uri,
               "first_mlflow_run": first_id, "root": root}
    finally:
        if previous is None:
            os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
        else:
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = previous


def cli(*args):
    """The CLI in this process (the report needs no Ray): exit code and stdout."""
    from typer.testing import CliRunner

    from trainlift.cli import app

    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, (result.output, result.exception)
    return json.loads(result.stdout)


def metrics_rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_reads_back_every_scalar_once_per_step_and_the_spec(tracked_run):
    from tensorboard.backend.event_processing import event_accumulator

    assert not tracked_run["stopped"]["finished"] and tracked_run["resumed"]["finished"]
    acc = event_accumulator.EventAccumulator(str(tracked_run["run_dir"] / "tensorboard"))
    acc.Reload()
    assert SCALAR_TAGS <= set(acc.Tags()["scalars"])
    assert "train/mfu" not in acc.Tags()["scalars"]  # None on CPU: left out, not logged as 0
    losses = {r["step"]: r["loss"] for r in metrics_rows(tracked_run["run_dir"]) if "loss" in r}
    for tag in SCALAR_TAGS - {"eval/loss"}:
        assert [e.step for e in acc.Scalars(tag)] == [1, 2, 3, 4], tag
    assert [pytest.approx(e.value, rel=1e-6) for e in acc.Scalars("train/loss")] == [losses[s] for s in (1, 2, 3, 4)]
    assert [e.step for e in acc.Scalars("eval/loss")] == [0, 4]
    spec_text = "".join(t.tensor_proto.string_val[0].decode() for t in acc.Tensors("job_spec/text_summary"))
    assert "name: obs-run" in spec_text and "trackers:" in spec_text


def test_mlflow_continues_one_run_across_the_resume_with_every_step_once(tracked_run):
    from mlflow.tracking import MlflowClient

    run_dir = tracked_run["run_dir"]
    run_id = json.loads((run_dir / "mlflow.json").read_text())["run_id"]
    assert run_id == tracked_run["first_mlflow_run"]
    client = MlflowClient(tracking_uri=tracked_run["mlflow_uri"])
    experiment = client.get_experiment_by_name("obs")  # run.name up to its first '-'
    found = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in found] == [run_id]
    losses = {r["step"]: r["loss"] for r in metrics_rows(run_dir) if "loss" in r}
    history = client.get_metric_history(run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(s, losses[s]) for s in (1, 2, 3, 4)]
    for tag in SCALAR_TAGS:
        assert client.get_metric_history(run_id, tag), tag
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.steps"] == "4" and run.data.params["run.name"] == "obs-run"
    assert run.data.tags["trainlift.export"] == f"{run_dir}/final"
    summary = json.loads(open(client.download_artifacts(run_id, "summary.json", str(tracked_run["root"]))).read())
    assert summary["steps"] == 4 and summary["finished"]


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def headless(browser, tmp_path, *args):
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
           *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_report_opens_in_a_browser_with_every_plot_loaded(tracked_run, tmp_path):
    """The HTML page is rendered by headless Chromium; a script in a copy of the page writes each image's
    natural size into the DOM, which --dump-dom returns; a screenshot of the page is taken too."""
    browser = chromium()
    if browser is None:
        pytest.skip("Chromium is not installed (apt-get install -y chromium; `make test` does it where apt works)")
    report = tmp_path / "report.html"
    result = cli("report", str(tracked_run["run_dir"]), "-o", str(report), "--png", str(tmp_path / "png"), "--json")
    assert result["plots"] == ["loss", "lr", "tokens_per_s"]  # no MFU plot on CPU
    assert result["restarts"] == {"obs-run": [{"step": 2, "label": "resumed at 2"}]}
    page = report.read_text()
    assert 'src="http' not in page and page.count('src="data:image/png;base64,') == 3  # self-contained
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", "<script>window.addEventListener('load', () => {"
                                  "const p = document.createElement('pre'); p.id = 'sizes';"
                                  "p.textContent = [...document.images].map(i => i.naturalWidth + 'x' + i.naturalHeight)"
                                  ".join(' '); document.body.appendChild(p);});</script></body>"))
    dom = headless(browser, tmp_path, "--virtual-time-budget=5000", "--dump-dom", probe.as_uri())
    sizes = re.search(r'<pre id="sizes">([^<]*)</pre>', dom.stdout)
    assert sizes, dom.stderr[-2000:]
    dims = [tuple(map(int, s.split("x"))) for s in sizes.group(1).split()]
    assert len(dims) == 3 and all(w >= 600 and h >= 300 for w, h in dims), dims
    shot = tmp_path / "shot.png"
    headless(browser, tmp_path, f"--screenshot={shot}", "--window-size=900,1400", "--hide-scrollbars", report.as_uri())
    assert shot.stat().st_size > 20_000  # a blank page compresses to a few kB
    assert {p.name for p in (tmp_path / "png").iterdir()} == {"loss.png", "lr.png", "tokens_per_s.png"}


def test_report_compare_overlays_two_runs(tracked_run, tmp_path):
    other = tracked_run["root"] / "runs" / "obs-copy"
    if not other.exists():
        shutil.copytree(tracked_run["run_dir"], other, ignore=shutil.ignore_patterns("checkpoint_*", "final"))
    cli("report", str(tracked_run["run_dir"]), "--compare", str(other), "-o", str(tmp_path / "cmp.html"), "--json")
    page = (tmp_path / "cmp.html").read_text()
    assert "obs-run vs obs-copy" in page and "<th>obs-copy</th>" in page


def test_runs_lists_steps_losses_and_state(tracked_run):
    rows = {r["name"]: r for r in cli("runs", str(tracked_run["root"] / "runs"), "--json")}
    row = rows["obs-run"]
    summary = tracked_run["resumed"]
    assert (row["steps"], row["total_steps"], row["state"]) == (4, 4, "finished")
    assert row["loss"] == pytest.approx(summary["final_loss"]) and row["eval_loss"] == pytest.approx(summary["eval_loss"])
    assert 0 <= row["age_s"] < 600
