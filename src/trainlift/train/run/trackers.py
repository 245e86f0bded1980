"""Optional experiment trackers, TensorBoard and MLflow, fed on rank 0 from the rows metrics.jsonl gets.

Neither runs in the step's critical path: `TrackedSink.write` only queues the row; a background thread
hands rows to the trackers, which buffer them and write them out when the recipe flushes (checkpoint and
evaluation boundaries), every FLUSH_INTERVAL_S, and at the end. A tracker that fails mid-run is dropped
with one warning: metrics.jsonl still has every row.

After a restart the loop replays the steps since the last checkpoint, and both trackers show the replayed
(final) values: TensorBoard hides what an earlier attempt logged past the checkpoint (`purge_step`); MLflow,
which cannot take a point back, is sent a step only once a checkpoint covers it or the attempt has ended.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import queue
import re
import sys
import threading
import time
from typing import Any

import pyarrow.fs as pafs
import yaml

from trainlift.config.job import JobSpec
from trainlift.errors import SpecError, UsageError
from trainlift.ops.run import environ_set
from trainlift.redact import refuse_uri_credentials, uri_credentials
from trainlift.train.run import metrics

FLUSH_INTERVAL_S = 30.0
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy")  # DPO's, per step and eval
SCALARS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
           "tokens_per_s": "train/tokens_per_s", "mfu": "train/mfu", "hfu": "train/hfu", "eval_loss": "eval/loss",
           "checkpoint_blocked_s": "train/checkpoint_blocked_s",
           **{name: f"train/{name}" for name in REWARDS}, **{f"eval_{name}": f"eval/{name}" for name in REWARDS}}
MLFLOW_STATE = "mlflow.json"  # the MLflow run a resumed run continues
# Read by MLflow in the workers; the secrets among MLflow's variables are left to the job's own environment.
FORWARDED_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE")
INSTALL_HINTS = {"tensorboard": "pip install 'trainlift[track]' (or: pip install tensorboard)",
                 "mlflow": "pip install 'trainlift[track]' (or: pip install mlflow-skinny)"}


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The tracked scalars in one metrics row, by tracker tag; missing, None and non-finite values left out."""
    out = {}
    for key, tag in SCALARS.items():
        value = row.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            out[tag] = float(value)
    return out


redact = uri_credentials


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """{"run": {"name": "x"}} -> {"run.name": "x"}; values as strings, URIs redacted."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = redact(json.dumps(value) if isinstance(value, (list, tuple)) else str(value))
    return flat


def tracking_uri(spec: JobSpec) -> str | None:
    return spec.run.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")


def experiment_name(spec: JobSpec) -> str:
    return spec.run.experiment or re.split(r"[-.]", spec.run.name, maxsplit=1)[0]


def worker_env() -> dict[str, str]:
    """The MLflow settings of the driver's environment that the workers need to reach the same server."""
    return {key: os.environ[key] for key in FORWARDED_ENV if key in os.environ}


def check(spec: JobSpec) -> None:
    """On the driver, before Ray starts: each tracker's library is installed and MLflow has a URI."""
    for name in spec.run.trackers:
        if importlib.util.find_spec(name) is None:  # the module is named like the tracker
            raise UsageError(f"run.trackers: {name} is not installed", hint=INSTALL_HINTS[name])
    if "mlflow" not in spec.run.trackers:
        return
    uri = tracking_uri(spec)
    if not uri:
        raise SpecError("run.mlflow_uri: the mlflow tracker needs a tracking server",
                        hint="set run.mlflow_uri or MLFLOW_TRACKING_URI, e.g. http://mlflow.example:5000")
    refuse_uri_credentials("MLFLOW_TRACKING_URI", uri)  # worker_env ships it in the workers' runtime_env
    from mlflow.tracking import MlflowClient

    try:
        one_try = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}  # not minutes of retries
        with environ_set(one_try):
            MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
    except Exception as exc:  # noqa: BLE001 - MLflow raises many types; its first line says what is wrong
        raise UsageError(f"run.mlflow_uri: MLflow at {redact(uri)} does not answer: "
                         f"{redact(_first_line(exc))[:300]}",
                         hint="check the URI and MLFLOW_TRACKING_TOKEN (or _USERNAME/_PASSWORD); a file store "
                              "also needs MLFLOW_ALLOW_FILE_STORE=true") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class TensorBoardTracker:
    """Event files in <run>/tensorboard/; on object storage written to a local mirror and uploaded on flush."""

    def __init__(self, spec: JobSpec, fs: pafs.FileSystem, run_path: str, resumed_at: int):
        from torch.utils.tensorboard import SummaryWriter

        self.mirror = metrics.LocalMirror(fs, f"{run_path}/tensorboard")
        # purge_step: after a restart from step N, TensorBoard hides what an earlier attempt logged past N.
        self.writer = SummaryWriter(self.mirror.path, purge_step=resumed_at + 1, flush_secs=3600)
        spec_yaml = redact(yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False))
        self.writer.add_text("job_spec", "```yaml\n" + spec_yaml + "```", global_step=resumed_at)

    def log(self, row: dict[str, Any]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        # One event per row holding every scalar: what add_scalar would write, at about half the CPU.
        values = [Summary.Value(tag=tag, simple_value=value) for tag, value in scalars(row).items()]
        if values:
            self.writer.file_writer.add_summary(Summary(value=values), row["step"], row.get("time"))

    def flush(self) -> None:
        self.writer.flush()
        self.mirror.upload()

    def checkpointed(self, step: int) -> None:
        pass  # purge_step hides a failed attempt's steps past its last checkpoint

    def close(self, summary: dict[str, Any] | None = None) -> None:
        self.writer.close()
        self.flush()
        self.mirror.remove()


class MlflowTracker:
    """One MLflow run per trainlift run: its id is kept in <run>/mlflow.json so a resumed run continues it.
    Rows wait in `pending` until a checkpoint covers their step (`checkpointed`) or the attempt ends: a step
    the loop may still replay is never sent. Steps the server already holds are not sent again."""

    def __init__(self, spec: JobSpec, fs: pafs.FileSystem, run_path: str, resumed_at: int):
        from mlflow.tracking import MlflowClient

        self.uri = tracking_uri(spec)
        self.client = MlflowClient(tracking_uri=self.uri)
        self.export_uri = f"{spec.run_uri}/final"
        self.pending: list = []
        self.durable_through: float = resumed_at
        state_path = f"{run_path}/{MLFLOW_STATE}"
        self.run_id = self._existing_run(fs, state_path)
        self.logged_through: dict[str, int] = {}
        if self.run_id is None:
            self.run_id = self._start(spec)
            with fs.open_output_stream(state_path) as out:
                out.write(json.dumps({"run_id": self.run_id, "tracking_uri": redact(self.uri)}).encode())
        else:
            self.client.update_run(self.run_id, status="RUNNING")
            for tag in SCALARS.values():
                history = self.client.get_metric_history(self.run_id, tag)
                if history:
                    self.logged_through[tag] = max(m.step for m in history)

    def _existing_run(self, fs: pafs.FileSystem, state_path: str) -> str | None:
        if fs.get_file_info(state_path).type != pafs.FileType.File:
            return None
        with fs.open_input_stream(state_path) as src:
            state = json.loads(src.read())
        if state.get("tracking_uri") != redact(self.uri):
            return None  # pointed at another server this time: start a run there
        try:
            self.client.get_run(state["run_id"])
        except Exception:  # noqa: BLE001 - deleted or unknown on this server: start a new run
            return None
        return state["run_id"]

    def _start(self, spec: JobSpec) -> str:
        from mlflow.entities import Param

        name = experiment_name(spec)
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        run = self.client.create_run(experiment_id, run_name=spec.run.name, tags={"trainlift.run": redact(spec.run_uri)})
        params = [Param(k, v[:6000]) for k, v in flatten(spec.model_dump(mode="json")).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(run.info.run_id, params=params[i:i + 100])
        return run.info.run_id

    def log(self, row: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        timestamp = int(row.get("time", time.time()) * 1000)
        for tag, value in scalars(row).items():
            if row["step"] > self.logged_through.get(tag, -1):
                self.pending.append(Metric(tag, value, timestamp, row["step"]))

    def flush(self) -> None:
        batch = [m for m in self.pending if m.step <= self.durable_through]
        self.pending = [m for m in self.pending if m.step > self.durable_through]
        for i in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def checkpointed(self, step: int) -> None:
        self.durable_through = max(self.durable_through, step)
        self.flush()

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if summary is None:  # the attempt failed: what it logged past its last checkpoint will be replayed
            self.flush()
            return
        self.durable_through = math.inf  # it finished or stopped at a checkpoint
        self.flush()
        self.client.log_dict(self.run_id, summary, "summary.json")
        for key in ("final_loss", "eval_loss", "eval_rewards/accuracy", "tokens_per_s", "mfu", "steps", "world_size"):
            if summary.get(key) is not None:
                self.client.set_tag(self.run_id, f"summary.{key}", str(summary[key]))
        if summary.get("finished"):
            self.client.set_tag(self.run_id, "trainlift.export", redact(self.export_uri))
        self.client.set_terminated(self.run_id, status="FINISHED" if summary.get("finished") else "KILLED")


TRACKERS = {"tensorboard": TensorBoardTracker, "mlflow": MlflowTracker}


class TrackedSink:
    """metrics.jsonl plus trackers: the JSONL row is written in the caller's thread, trackers get it from a
    background thread."""

    def __init__(self, jsonl: metrics.JsonlSink, trackers: list):
        self.jsonl, self.trackers = jsonl, trackers
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._drain, name="trainlift-trackers", daemon=True)
        self.thread.start()

    def write(self, row: dict) -> None:
        self.jsonl.write(row)
        self.queue.put(("row", row))

    def flush(self) -> None:
        self.jsonl.flush()
        self.queue.put(("flush", None))

    def checkpointed(self, step: int) -> None:
        self.queue.put(("checkpointed", step))

    def recorded_initial_eval(self) -> float | None:
        return self.jsonl.recorded_initial_eval()

    def close(self, summary: dict | None = None) -> None:
        self.jsonl.close()
        self.queue.put(("close", summary))
        self.thread.join()

    def _drain(self) -> None:
        flush_at = time.monotonic() + FLUSH_INTERVAL_S
        while True:
            try:
                kind, payload = self.queue.get(timeout=max(0.0, flush_at - time.monotonic()))
            except queue.Empty:
                kind, payload = "flush", None
            if kind in ("row", "checkpointed"):
                self._each("log" if kind == "row" else "checkpointed", payload)
                continue
            if kind == "close":
                self._each("close", payload)
                return
            self._each("flush")
            flush_at = time.monotonic() + FLUSH_INTERVAL_S

    def _each(self, method: str, *args) -> None:
        for tracker in list(self.trackers):
            try:
                getattr(tracker, method)(*args)
            except Exception as exc:  # noqa: BLE001 - a tracker must not end the run
                self.trackers.remove(tracker)
                _warn(f"{type(tracker).__name__} stopped logging: {_first_line(exc)}")


def _warn(message: str) -> None:
    print(f"trainlift: {redact(message)}; metrics.jsonl still gets every row", file=sys.stderr, flush=True)


def open_sink(spec: JobSpec, fs: pafs.FileSystem, run_path: str, resumed_at: int):
    """Rank 0's sink: metrics.jsonl, plus the spec's trackers when it names any. A tracker that cannot start
    here (the driver checked it could) is left out with a warning rather than ending the run."""
    jsonl = metrics.JsonlSink(fs, f"{run_path}/metrics.jsonl")
    if not spec.run.trackers:
        return jsonl
    started = []
    for name in spec.run.trackers:
        try:
            started.append(TRACKERS[name](spec, fs, run_path, resumed_at))
        except Exception as exc:  # noqa: BLE001 - the run's metrics are safe in metrics.jsonl
            _warn(f"the {name} tracker did not start: {_first_line(exc)}")
    return TrackedSink(jsonl, started)
