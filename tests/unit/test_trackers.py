"""The trackers against the real libraries, without Ray: a restart that repeats steps, a failing tracker,
the spec checks. (tests/integration/test_observability.py covers them inside a real Ray Train run.)"""

import json
import time

import pyarrow.fs as pafs
import pytest

from trainlift.config.job import validate_job_spec
from trainlift.errors import SpecError
from trainlift.train.run import trackers


def spec_for(tmp_path, **run):
    return validate_job_spec({"model": {"path": "m"}, "data": {"train": "t.jsonl"},
                              "run": {"name": "exp-a", "storage": str(tmp_path), **run}})


def row(step, loss):
    return {"step": step, "loss": loss, "lr": 0.1, "grad_norm": 2.0, "tokens_per_s": 50.0, "mfu": None,
            "time": time.time()}


def attempt(spec, run_path, resumed_at, rows, summary=None, checkpoint_at=None):
    sink = trackers.open_sink(spec, pafs.LocalFileSystem(), str(run_path), resumed_at)
    for r in rows:
        sink.write(r)
        if r["step"] == checkpoint_at:
            sink.flush()
            sink.checkpointed(r["step"])
    sink.close(summary)


def test_scalars_leave_out_missing_and_non_finite_values():
    assert trackers.scalars({"step": 1, "loss": float("nan"), "lr": 0.1, "mfu": None, "eval_loss": 2}) == {
        "train/lr": 0.1, "eval/loss": 2.0}


def test_flattened_params_and_spec_text_hide_uri_credentials(tmp_path):
    dumped = spec_for(tmp_path, trackers=["mlflow"]).model_dump(mode="json")
    dumped["run"]["mlflow_uri"] = "https://bob:s3cret@mlflow.example"  # a spec refuses it; flatten masks it still
    flat = trackers.flatten(dumped)
    assert flat["run.mlflow_uri"] == "https://***@mlflow.example" and flat["train.steps"] == "100"
    assert "s3cret" not in json.dumps(flat)


def test_mlflow_without_a_tracking_uri_is_a_spec_error(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(SpecError, match="run.mlflow_uri"):
        trackers.check(spec_for(tmp_path, trackers=["mlflow"]))
    with pytest.raises(SpecError, match="run.trackers"):
        spec_for(tmp_path, trackers=["wandb"])


def test_an_mlflow_store_that_does_not_answer_stops_the_run_before_ray_starts(tmp_path, monkeypatch):
    from trainlift.errors import UsageError

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # MLflow refuses a file store without it
    with pytest.raises(UsageError, match=r"run.mlflow_uri: MLflow at file://\S+ does not answer") as exc:
        trackers.check(spec_for(tmp_path, trackers=["mlflow"], mlflow_uri=f"file://{tmp_path / 'mlruns'}"))
    assert "MLFLOW_ALLOW_FILE_STORE=true" in exc.value.one_line()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    trackers.check(spec_for(tmp_path, trackers=["mlflow"], mlflow_uri=f"file://{tmp_path / 'mlruns'}"))


def test_after_a_restart_both_trackers_show_the_replayed_values_of_each_step_once(tmp_path, monkeypatch):
    """A worker-group restart from checkpoint 2 after steps 1-3 were logged (as after a crash at step 3): the
    replayed step 3 (loss 1.4) is what MLflow and TensorBoard both show, not the failed attempt's 1.5."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing import event_accumulator

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file://{tmp_path / 'mlruns'}"
    spec = spec_for(tmp_path, trackers=["tensorboard", "mlflow"], mlflow_uri=uri)
    run_path = tmp_path / "exp-a"
    run_path.mkdir()
    attempt(spec, run_path, 0, [row(1, 3.0), row(2, 2.0), row(3, 1.5)], checkpoint_at=2)
    run_id = json.loads((run_path / "mlflow.json").read_text())["run_id"]
    client = MlflowClient(tracking_uri=uri)
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == [1, 2]  # 3 awaits a checkpoint
    attempt(spec, run_path, 2, [row(3, 1.4), row(4, 1.0)], summary={"finished": True, "steps": 4})

    mlflow_points = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/loss"))
    assert mlflow_points == [(1, 3.0), (2, 2.0), (3, 1.4), (4, 1.0)]
    assert client.get_experiment(client.get_run(run_id).info.experiment_id).name == "exp"
    assert len(client.search_runs([client.get_experiment_by_name("exp").experiment_id])) == 1
    acc = event_accumulator.EventAccumulator(str(run_path / "tensorboard"))
    acc.Reload()
    tensorboard_points = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert tensorboard_points == [(s, pytest.approx(v)) for s, v in mlflow_points]


def test_a_failing_tracker_is_dropped_with_one_warning_and_metrics_jsonl_keeps_every_row(tmp_path, capsys):
    from trainlift.train.run import metrics

    class Broken:
        def log(self, row):
            raise ConnectionError("tracking server at https://bob:pw@host unreachable")

    jsonl = metrics.JsonlSink(pafs.LocalFileSystem(), str(tmp_path / "metrics.jsonl"))
    sink = trackers.TrackedSink(jsonl, [Broken()])
    for step in (1, 2, 3):
        sink.write(row(step, 1.0))
    sink.close()
    err = capsys.readouterr().err
    assert err.count("stopped logging") == 1 and "pw@" not in err and "metrics.jsonl still gets every row" in err
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_mlflow_secret_needs_the_mlflow_tracker_and_the_pods_must_read_a_token_or_user_and_password(tmp_path):
    from trainlift.config.cluster import parse_cluster_spec
    from trainlift.render.job_secrets import mlflow_secret_problems

    with pytest.raises(SpecError, match="mlflow_secret is set but run.trackers does not name mlflow"):
        spec_for(tmp_path, mlflow_secret="mlflow-auth")
    job = spec_for(tmp_path, trackers=["mlflow"], mlflow_uri="https://mlflow.example", mlflow_secret="mlflow-auth")

    def cluster(*envs):
        return parse_cluster_spec({"name": "c", "availability_zones": ["us-east-2a", "us-east-2b"],
                                   "workers": [{"instance_type": "g6.12xlarge", "count": 1,
                                                "availability_zones": ["us-east-2a"]}],
                                   "secrets": [{"env": e, "secret": "mlflow-auth", "key": e.lower()} for e in envs]})

    assert [p.path for p in mlflow_secret_problems(cluster("MLFLOW_TRACKING_USERNAME"), job)] == ["run.mlflow_secret"]
    assert mlflow_secret_problems(cluster("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"), job) == []
    assert mlflow_secret_problems(cluster("MLFLOW_TRACKING_TOKEN"), job) == []
    assert mlflow_secret_problems(cluster(), spec_for(tmp_path, trackers=["mlflow"], mlflow_uri="https://m")) == []
