"""Run a job spec with Ray Train's TorchTrainer, on an embedded local Ray or an existing cluster.

The driver checks everything it can before Ray starts (data, model, run
directory), so bad input fails in a second with one line, not in a worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pyarrow.fs as pafs

from trainlift.config.job import JobSpec
from trainlift.doctor.nccl_log import nccl_log_env
from trainlift.errors import TrainliftError, UsageError
from trainlift.ops import localray
from trainlift.train.data import cache as datacache, source as datasource
from trainlift.train.model.build import build_config, materialize, max_positions
from trainlift.train.run import failures, trackers

EXIT_STOPPED = 3  # the run stopped at a checkpoint before its last step; rerun to resume
RAY_CHECKPOINT_LIST = "checkpoint_manager_snapshot.json"  # Ray Train V2's record of reported checkpoints


def _local(path: str | None) -> str | None:
    """Absolute form of a local path; URIs pass through."""
    return path if path is None or "://" in path else str(Path(path).expanduser().resolve())


def _local_if_exists(path: str | None) -> str | None:
    """Local paths that exist become absolute; anything else (a hub id) passes through."""
    return _local(path) if path is not None and Path(path).expanduser().exists() else path


def resolve_paths(spec: JobSpec) -> JobSpec:
    """Make local paths absolute: Ray workers do not run in the driver's directory."""
    resolved = spec.model_copy(deep=True)
    model = resolved.model
    model.path = _local(model.path) if model.config is not None else _local_if_exists(model.path)
    model.tokenizer = _local_if_exists(model.tokenizer)
    if isinstance(model.config, str):
        model.config = _local(model.config)
    resolved.data.train = _local(spec.data.train)
    resolved.data.eval = _local(spec.data.eval)
    resolved.run.storage = _local(spec.run.storage)
    return resolved


def check_remote_storage(uri: str) -> None:
    """Credentials, endpoint and bucket work, before any worker starts."""
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
        bucket_type = fs.get_file_info(path.split("/", 1)[0]).type
    except (OSError, ValueError) as exc:
        raise UsageError(f"run.storage: cannot reach {uri} ({str(exc).splitlines()[0]})",
                         hint="check AWS credentials, AWS_REGION and AWS_ENDPOINT_URL") from None
    if bucket_type == pafs.FileType.NotFound:
        raise UsageError(f"run.storage: bucket of {uri} does not exist", hint="create it or fix run.storage")


def check_run_dir(spec: JobSpec) -> None:
    if spec.is_remote_storage:
        check_remote_storage(spec.run_uri)
        return
    run_dir = Path(spec.run_uri)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"run.storage: cannot write to {run_dir} ({exc.strerror})",
                         hint="choose a writable directory with --run-dir or --set run.storage=...") from None


def _model_config(spec: JobSpec):
    from transformers import AutoConfig

    if spec.model.path and (Path(spec.model.path) / "config.json").exists():
        return AutoConfig.from_pretrained(spec.model.path)
    if spec.model.config is not None:
        return build_config(spec.model.config)
    try:
        return AutoConfig.from_pretrained(spec.model.path)
    except (OSError, ValueError) as exc:
        raise UsageError(f"model.path: cannot load a model config from {spec.model.path!r}",
                         hint="give a local model directory, a reachable hub id, or model.config") from exc


def preflight(spec: JobSpec) -> None:
    """Every check that needs no Ray: data files exist (their rows are checked as the data cache is built, in
    `prepare_data`), seq_len fits the model, storage is writable."""
    for name, path in (("data.train", spec.data.train), ("data.eval", spec.data.eval)):
        if path is not None:
            datasource.check_schema(datasource.resolve(path, name), spec.data.format, spec.data.columns)
    model_config = _model_config(spec)
    limit = max_positions(model_config)
    if limit is not None and spec.data.seq_len > limit:
        raise UsageError(f"data.seq_len: {spec.data.seq_len} is above the model's maximum of {limit} positions",
                         hint=f"--set data.seq_len={limit}")
    if spec.model.lora is not None:
        from trainlift.train.model import lora

        lora.validate(model_config, spec.model.lora)
    trackers.check(spec)
    check_run_dir(spec)


def check_model_readable_by_workers(spec: JobSpec, node_ips: set[str], driver_ip: str) -> None:
    """model.config with a local model.path builds the model on the driver's disk: workers on other hosts cannot
    read it there, unless it lies under a local run.storage (which a multi-node run mounts on every node)."""
    model = spec.model
    if model.config is None or not model.path or "://" in model.path:
        return
    others = node_ips - {driver_ip}
    if not others:
        return
    if not spec.is_remote_storage and Path(model.path).is_relative_to(spec.run.storage):
        return
    raise UsageError(f"model.path: {model.path} would be built on this machine's disk, which workers on "
                     f"{len(others)} other node(s) cannot read",
                     hint="drop model.path (each worker builds the same model from model.config and train.seed) "
                     "or put it under a run.storage volume that every node mounts")


def prepare_model(spec: JobSpec) -> None:
    """Build and save the model first when the spec gives both model.config and model.path."""
    if spec.model.path and spec.model.config is not None:
        materialize(spec.model.path, spec.model.config, spec.model.tokenizer or spec.model.path, spec.train.seed)


def prepare_data(spec: JobSpec) -> dict[str, dict]:
    """Tokenize and pack each split once into the data cache under run.storage (skipped when it is there)."""
    from trainlift.train.model.build import load_tokenizer

    return datacache.prepare_splits(spec, load_tokenizer(spec.model))


def ensure_ray(address: str | None, num_cpus: int) -> bool:
    """Attach to a cluster or start an embedded one; returns whether this call started Ray."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        try:
            # A head bound to loopback (`trainlift local up`) only accepts a driver that says it is on loopback too.
            local = localray.is_loopback(address)
            if local:
                localray.skip_cluster_only_train_features()
            ray.init(address=address, log_to_driver=False, **({"_node_ip_address": "127.0.0.1"} if local else {}))
        except Exception as exc:  # noqa: BLE001 - Ray raises several types for an unreachable head
            raise TrainliftError(f"cannot reach the Ray cluster at {address}: {str(exc).splitlines()[0]}",
                                 hint="check the address, or drop --address to run on an embedded local Ray") from None
        return False
    localray.start_in_process(num_cpus)
    return True


def _progress_board():
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # On the driver's node, like Ray Train's controller: losing another node must not take the board with it.
    @ray.remote(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False))
    class ProgressBoard:
        """Rank 0 posts each step here without waiting; the driver polls it for the progress bar. The latest
        start row is kept apart from the latest row, so a short run's (re)start is not lost between polls."""

        def __init__(self):
            self.start: dict[str, Any] = {}
            self.latest: dict[str, Any] = {}
            self.summary: dict[str, Any] = {}
            self.stop_reason: str | None = None

        def request_stop(self, reason: str) -> None:
            self.stop_reason = reason

        def stop_requested(self) -> str | None:
            return self.stop_reason

        def update(self, row: dict[str, Any]) -> None:
            if row.get("event") == "start":
                self.start = row
            self.latest = row

        def finish(self, summary: dict[str, Any]) -> None:
            self.summary = summary

        def get(self) -> list[dict[str, Any]]:
            """The latest start row, then the latest row if a step followed it."""
            rows = [self.start] if self.start else []
            if self.latest and self.latest is not self.start:
                rows.append(self.latest)
            return rows

        def get_summary(self) -> dict[str, Any]:
            return self.summary

    return ProgressBoard.remote()


def _poll(board, on_update: Callable[[dict], None], stop: threading.Event) -> None:
    import ray

    while not stop.wait(0.5):
        try:
            for row in ray.get(board.get.remote(), timeout=5):
                on_update(row)
        except Exception:  # noqa: BLE001 - progress is best effort; the run's outcome comes from fit()
            pass


@contextlib.contextmanager
def _stop_on_signals(board):
    """First SIGTERM/SIGINT: checkpoint at the next step boundary and stop. A second one: stop now."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[str] = []

    def handler(signum, _frame):
        if received:
            raise KeyboardInterrupt
        received.append(signal.Signals(signum).name)
        board.request_stop.remote(received[0])
        print(f"{received[0]}: saving a checkpoint at the next step boundary, then stopping "
              "(send it again to stop at once)", file=sys.stderr, flush=True)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old_handler in previous.items():
            signal.signal(sig, old_handler)


def scaling_for(spec: JobSpec, workers: int | None):
    import ray
    from ray.train import ScalingConfig

    gpus = int(ray.cluster_resources().get("GPU", 0))
    use_gpu = spec.scaling.device == "cuda" or (spec.scaling.device == "auto" and gpus > 0)
    count = workers or spec.scaling.workers
    if count == "auto":
        count = gpus if use_gpu else max(1, int(ray.cluster_resources().get("CPU", 1)) // spec.scaling.cpus_per_worker)
    if isinstance(count, tuple) and count[0] == count[1]:
        count = count[0]
    # A (min, max) tuple makes Ray Train elastic: after a failure it restarts with as many workers as fit.
    return ScalingConfig(num_workers=count, use_gpu=use_gpu, resources_per_worker={"CPU": spec.scaling.cpus_per_worker}), use_gpu


def forget_ray_checkpoint_list(spec: JobSpec) -> None:
    """Ray Train refuses to start a run whose saved checkpoint list names a directory that is gone, and trainlift
    prunes old checkpoints; the recipe resumes from the newest complete one in storage, so drop Ray's list."""
    fs, path = pafs.FileSystem.from_uri(spec.run_uri)
    with contextlib.suppress(FileNotFoundError):
        fs.delete_file(f"{path}/{RAY_CHECKPOINT_LIST}")


def write_summary(spec: JobSpec, summary: dict[str, Any]) -> None:
    fs, path = pafs.FileSystem.from_uri(spec.run_uri)
    with fs.open_output_stream(f"{path}/summary.json") as out:
        out.write(json.dumps(summary, indent=2, sort_keys=True).encode())


def run_training(
    spec: JobSpec,
    *,
    address: str | None = None,
    workers: int | None = None,
    stop_at_step: int | None = None,
    skip_doctor: bool = False,
    on_update: Callable[[dict], None] | None = None,
) -> dict[str, Any]:
    """Train `spec` to completion (or to `stop_at_step`); returns the summary written to summary.json."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig

    from trainlift.train.run import raytrainer  # imports Ray Train: not before the CLI has set Ray's auth mode
    from trainlift.train.recipe import train_loop_per_worker

    started_at = time.time()
    spec = resolve_paths(spec)
    preflight(spec)
    requested = workers or spec.scaling.max_workers or 1
    started_ray = ensure_ray(address, num_cpus=max(os.cpu_count() or 1, requested * spec.scaling.cpus_per_worker))
    stop = threading.Event()
    try:
        check_model_readable_by_workers(spec, {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]},
                                        ray.util.get_node_ip_address())
        prepare_model(spec)
        data_cache = prepare_data(spec)
        scaling, use_gpu = scaling_for(spec, workers)
        nccl_log_prefix, nccl_env = None, {}
        if use_gpu and "NCCL_DEBUG_FILE" not in os.environ:
            nccl_log_prefix = f"/tmp/trainlift-nccl-{spec.run.name}-{int(started_at)}"
            nccl_env = nccl_log_env(nccl_log_prefix)
        forget_ray_checkpoint_list(spec)
        board = _progress_board()
        poller = threading.Thread(target=_poll, args=(board, on_update or (lambda _: None), stop), daemon=True)
        poller.start()
        trainer = raytrainer.torch_trainer(
            train_loop_per_worker,
            use_gpu=use_gpu,
            train_loop_config={"spec": spec.model_dump(), "board": board, "stop_at_step": stop_at_step,
                               "skip_doctor": skip_doctor, "nccl_log_prefix": nccl_log_prefix,
                               "data_cache": data_cache},
            scaling_config=scaling,
            run_config=RunConfig(
                name=spec.run.name,
                storage_path=spec.run.storage,
                # Ray retries a worker group that cannot start (lost node, fixed size) forever by default.
                failure_config=FailureConfig(max_failures=spec.run.max_failures,
                                             controller_failure_limit=failures.START_RETRIES),
                checkpoint_config=CheckpointConfig(num_to_keep=None),
                worker_runtime_env={"env_vars": {**nccl_env, **trackers.worker_env()}},
            ),
        )
        try:
            with _stop_on_signals(board):
                trainer.fit()
        except Exception as exc:  # noqa: BLE001 - Ray wraps worker errors; show the root cause in one line
            raise failures.explain(spec, exc) from exc
        stop.set()
        poller.join(timeout=2)
        if on_update is not None:
            for row in ray.get(board.get.remote()):
                on_update(row)
        summary = ray.get(board.get_summary.remote())
        summary["stopped_by"] = ray.get(board.stop_requested.remote())
        summary.update(run=spec.run_uri, name=spec.run.name, wall_time_s=time.time() - started_at, data_cache=data_cache)
        write_summary(spec, summary)
        return summary
    finally:
        stop.set()
        if started_ray:
            ray.shutdown()
