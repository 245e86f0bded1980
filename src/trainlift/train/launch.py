"""Run a job spec with Ray Train's TorchTrainer, on an embedded local Ray or an existing cluster.

The driver checks everything it can before Ray starts (data, model, run
directory), so bad input fails in a second with one line, not in a worker.
It imports neither torch nor transformers on the common path (a local model
directory and a data cache that is there): the workers import them anyway,
and on the driver they were seconds before every start.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pyarrow.fs as pafs

from trainlift import rundir, run_lease
from trainlift.config.job import JobSpec
from trainlift.doctor.nccl_log import nccl_log_env
from trainlift.errors import TrainliftError, UsageError
from trainlift.ops import localray, ray_output
from trainlift.train.data import cache as datacache
from trainlift.train.data import source as datasource
from trainlift.train.run import board as progress, checkpoint, failures, metrics, preflight, spec_record, trackers

EXIT_STOPPED = 3  # the run stopped at a checkpoint before its last step; rerun to resume
RAY_CHECKPOINT_LIST = "checkpoint_manager_snapshot.json"  # Ray Train V2's record of reported checkpoints
# The Hugging Face libraries' bars ("Loading weights", "Writing model shards") would land in the job's log between
# trainlift's progress lines, which `submit --follow` shows.
QUIET_WORKERS = {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def prepare_model(spec: JobSpec) -> None:
    """Build and save the model first when the spec gives both model.config and model.path."""
    if spec.model.path and spec.model.config is not None and not (Path(spec.model.path) / "config.json").exists():
        from trainlift.train.model.build import materialize

        materialize(spec.model.path, spec.model.config, spec.model.tokenizer or spec.model.path, spec.train.seed)


def prepare_data(spec: JobSpec) -> dict[str, dict]:
    """Tokenize and pack each split once into the data cache under run.storage (skipped when it is there), and
    record in <run>/data.json what each split was drawn from (its sources, their weights and examples drawn)."""
    @functools.cache
    def tokenizer():
        from trainlift.train.model.build import load_tokenizer

        return load_tokenizer(spec.model)

    keys = datacache.prepare_splits(spec, tokenizer)
    fs, path = pafs.FileSystem.from_uri(spec.run_uri)
    fs.create_dir(path, recursive=True)
    rundir.write_file(fs, f"{path}/data.json", json.dumps(datacache.composition(spec, keys), indent=2,
                                                          sort_keys=True).encode())
    return keys


def ensure_ray(address: str | None, num_cpus: int, log_to_driver: bool = False) -> bool:
    """Attach to a cluster or start an embedded one (forwarding the workers' output to this process with
    `log_to_driver`); returns whether this call connected this process to Ray (started it or attached), so that
    the run disconnects at its end: the workers' last lines then stop where the run stops."""
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
            os.environ.update(localray.private_ray_env())  # Ray Train's lock files: not in the shared /tmp
            ray.init(address=address, log_to_driver=log_to_driver,
                     **({"_node_ip_address": "127.0.0.1"} if local else {}))
        except Exception as exc:  # noqa: BLE001 - Ray raises several types for an unreachable head
            raise TrainliftError(f"cannot reach the Ray cluster at {address}: {str(exc).splitlines()[0]}",
                                 hint="check the address, or drop --address to run on an embedded local Ray") from None
        return True
    localray.start_in_process(num_cpus, log_to_driver)
    return True


def scaling_for(spec: JobSpec):
    import ray
    from ray.train import ScalingConfig

    gpus = int(ray.cluster_resources().get("GPU", 0))
    use_gpu = spec.scaling.device == "cuda" or (spec.scaling.device == "auto" and gpus > 0)
    count = spec.scaling.workers
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
    """summary.json, strict JSON: a figure that is not a number (no step trained, a loss that diverged) is null."""
    fs, path = pafs.FileSystem.from_uri(spec.run_uri)
    rundir.write_file(fs, f"{path}/summary.json", json.dumps(metrics.finite_or_null(summary), indent=2,
                                                             sort_keys=True, allow_nan=False).encode())


def finished_summary(spec: JobSpec) -> dict[str, Any] | None:
    """The run's summary when it already finished as many steps as the spec asks for (a rerun has nothing to
    train: it must neither start Ray nor touch what the run left); None otherwise."""
    fs, path = pafs.FileSystem.from_uri(spec.run_uri)
    try:
        with fs.open_input_stream(f"{path}/summary.json") as src:
            summary = json.loads(src.read())
    except (OSError, ValueError):  # none yet (FileNotFoundError is an OSError), or not JSON
        return None
    done = isinstance(summary, dict) and summary.get("finished") and (summary.get("steps") or 0) >= spec.train.steps
    return summary if done else None


def schedule_note(spec: JobSpec, latest: int) -> str | None:
    """What resuming at checkpoint `latest` does to the LR schedule, when train.steps is not what it was planned
    for (from the schedule the checkpoint's scheduler state holds)."""
    from trainlift.train.run import schedule

    fs, path = rundir.open_uri(spec.run_uri)
    try:
        with fs.open_input_stream(f"{path}/{checkpoint.dir_name(latest)}/{checkpoint.TRAINER_STATE}") as src:
            lambdas = json.loads(src.read()).get("scheduler", {}).get("lr_lambdas") or [None]
    except (OSError, ValueError, AttributeError):
        return None
    planned = schedule.from_state(lambdas[0])
    train = spec.train
    return None if planned is None else schedule.extension_note(
        spec.run.name, planned, train.steps, latest, train.schedule_extension, train.warmup_steps, train.lr)


def has_trained(spec: JobSpec) -> bool:
    """Whether the run holds anything a rerun would go on from: a summary (it finished or stopped) or a complete
    checkpoint."""
    fs, path = pafs.FileSystem.from_uri(spec.run_uri)
    return (fs.get_file_info(f"{path}/summary.json").type == pafs.FileType.File
            or rundir.latest_checkpoint_step(spec.run_uri) is not None)


@dataclass(frozen=True)
class Prepared:
    """What the driver prepares once Ray is up, for the trainer."""

    data_cache: dict[str, dict]
    scaling: Any
    use_gpu: bool
    nccl_log_prefix: str | None
    worker_env: dict[str, str]


def prepare_before_ray(spec: JobSpec) -> dict[str, dict]:
    """Before Ray starts, so a bad row or a missing tokenizer costs no cluster start: the model built where the spec
    asks for one, then every split read, tokenized and packed into the data cache."""
    prepare_model(spec)
    return prepare_data(spec)


def prepare(spec: JobSpec, started_at: float, data_cache: dict[str, dict]) -> Prepared:
    """After Ray starts: the model on a disk every worker reads, the worker count and device, the workers'
    environment (NCCL's log file on GPUs, for the transport check), and no stale Ray checkpoint list."""
    import ray

    node_ips, driver_ip = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}, ray.util.get_node_ip_address()
    preflight.check_model_readable_by_workers(spec, node_ips, driver_ip)
    if node_ips <= {driver_ip}:
        preflight.check_staging_space(spec)  # every worker stages its checkpoints on this machine
    scaling, use_gpu = scaling_for(spec)
    if spec.scaling.workers == "auto":
        preflight.check_parallel(spec, scaling.num_workers)
    nccl_log_prefix, nccl_env = None, {}
    if use_gpu and "NCCL_DEBUG_FILE" not in os.environ:
        nccl_log_prefix = f"/tmp/trainlift-nccl-{spec.run.name}-{int(started_at)}"
        nccl_env = nccl_log_env(nccl_log_prefix)
    forget_ray_checkpoint_list(spec)
    return Prepared(data_cache, scaling, use_gpu, nccl_log_prefix,
                    {**nccl_env, **allocator_env(use_gpu, os.environ), **trackers.worker_env(), **QUIET_WORKERS})


def allocator_env(use_gpu: bool, environ) -> dict[str, str]:
    """On GPUs, PyTorch's allocator with expandable segments: packed rows and chunked losses allocate sizes that
    vary from step to step, which fragment fixed segments. A setting in the driver's environment is kept."""
    if not use_gpu or "PYTORCH_CUDA_ALLOC_CONF" in environ:
        return {}
    return {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def build_trainer(spec: JobSpec, prepared: Prepared, board, train_loop: Callable[[dict], None] | None,
                  stop_at_step: int | None, skip_doctor: bool):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig

    from trainlift.train.run import raytrainer

    return raytrainer.torch_trainer(
        train_loop or raytrainer.recipe_train_loop,
        use_gpu=prepared.use_gpu,
        train_loop_config={"spec": spec.model_dump(), "board": board, "stop_at_step": stop_at_step,
                           "skip_doctor": skip_doctor, "nccl_log_prefix": prepared.nccl_log_prefix,
                           "data_cache": prepared.data_cache},
        scaling_config=prepared.scaling,
        run_config=RunConfig(
            name=spec.run.name,
            storage_path=spec.run.storage,
            # Ray retries a worker group that cannot start (lost node, fixed size) forever by default.
            failure_config=FailureConfig(max_failures=spec.run.max_failures,
                                         controller_failure_limit=failures.START_RETRIES),
            checkpoint_config=CheckpointConfig(num_to_keep=None),
            worker_runtime_env={"env_vars": prepared.worker_env},
        ),
    )


def fit(trainer, spec: JobSpec, board, output: ray_output.RunOutput) -> None:
    since = time.time()
    try:
        with progress.stop_on_signals(board):
            trainer.fit()
    except Exception as exc:  # noqa: BLE001 - Ray wraps worker errors; show the root cause in one line
        raise failures.explain(spec, exc, output.log_path, output.warning_since(since)) from exc


def summarize(spec: JobSpec, board, prepared: Prepared, started_at: float) -> dict[str, Any]:
    """The run's summary, as rank 0 left it on the board, with how it stopped; written to summary.json."""
    import ray

    summary = ray.get(board.get_summary.remote())
    summary["stopped_by"] = ray.get(board.stop_requested.remote())
    summary.update(run=spec.run_uri, name=spec.run.name, wall_time_s=time.time() - started_at,
                   data_cache=prepared.data_cache, driver_log=str(ray_output.run_log_path(spec.run_uri, spec.run.name)))
    write_summary(spec, summary)
    return summary


def run_training(
    spec: JobSpec,
    *,
    address: str | None = None,
    stop_at_step: int | None = None,
    skip_doctor: bool = False,
    on_update: Callable[[dict], None] | None = None,
    train_loop: Callable[[dict], None] | None = None,
    verbose: bool = False,
    allow_spec_change: bool = False,
) -> dict[str, Any]:
    """Train `spec` to completion (or to `stop_at_step`); returns the summary written to summary.json.
    `train_loop` replaces the recipe's train function on the workers (benchmarks wrap it). What Ray and the
    libraries print goes to the run's driver.log, and onto the console too with `verbose`. A run started with
    another training spec is refused unless `allow_spec_change`."""
    spec = preflight.check(spec)
    fields = spec_record.training_fields(spec, datasource.fingerprint_of(datacache.splits(spec)["train"].sources))
    changes = spec_record.check(spec, fields, allow_spec_change, trained=has_trained(spec))
    finished = finished_summary(spec)
    if finished is not None:
        return {**finished, "already_finished": True}
    if (latest := rundir.latest_checkpoint_step(spec.run_uri)) is not None:
        from trainlift.train.run import safe_load  # torch: only when there is a checkpoint to check

        safe_load.check_latest_metadata(*rundir.open_uri(spec.run_uri), latest)
    if changes and on_update is not None:
        on_update({"event": "note", "text": f"run {spec.run.name} goes on with a changed spec: {'; '.join(changes)}"})
    if latest is not None and on_update is not None and (note := schedule_note(spec, latest)) is not None:
        on_update({"event": "note", "text": note})
    log_path = ray_output.run_log_path(spec.run_uri, spec.run.name)
    with driver_record(spec, fields) as taken_over, ray_output.RunOutput(log_path, verbose) as output:
        if taken_over and on_update is not None:
            on_update({"event": "note", "text": taken_over})
        return _run_with_ray(spec, address, stop_at_step, skip_doctor, on_update, train_loop, output)


@contextlib.contextmanager
def driver_record(spec: JobSpec, training_fields: dict[str, Any] | None = None):
    """<run>/driver.json names this process while it drives the run: claimed atomically (run_lease), so a second
    driver is refused in one line before anything is written, and `trainlift runs` can tell a run whose driver
    died (killed, machine lost) from one that is going. The run's spec record is written once the run is held.
    Yields the note that this driver took over from a dead one, if it did."""
    import socket

    record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    try:
        replaced = run_lease.claim(spec.run_uri, record, lambda holder: holds_run(spec, holder))
    except run_lease.RunHeld as held:
        raise held_error(spec, held.holder) from None
    if training_fields is not None:
        prepare_model(spec)  # first, so that the record holds what a model built from model.config is
        spec_record.write(spec, spec_record.with_built_model(spec, training_fields))
    try:
        yield None if replaced is None else (
            f"run {spec.run.name}: its last driver (pid {replaced.get('pid')} on {replaced.get('host')}) is gone "
            "without ending it; this one takes the run over")
    finally:
        run_lease.release(spec.run_uri)


def holds_run(spec: JobSpec, driver: dict[str, Any]) -> bool:
    """Whether `driver` still drives the run: its process alive on this host; on another host, the run's metrics
    written within the last minutes."""
    try:
        run = rundir.read_run(spec.run_uri)
    except UsageError:  # no metrics yet: only a live driver on this host holds it
        run = rundir.Run(spec.run.name, spec.run_uri, [], None, None, None, None)
    run.driver = driver
    return rundir.state(run, time.time()) == "running"


def held_error(spec: JobSpec, driver: dict[str, Any]) -> UsageError:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(driver.get("started", 0)))
    elsewhere = "" if rundir.driver_alive(driver) else (
        f"; if that driver is gone, the run counts as stopped {rundir.RUNNING_WINDOW_S / 60:.0f} minutes after "
        "its last metrics")
    return UsageError(f"run {spec.run.name} is being trained by pid {driver.get('pid')} on {driver.get('host')} "
                      f"since {since}" + elsewhere, hint="wait for it to end or stop it, or give this one another run.name")


def _run_with_ray(spec: JobSpec, address: str | None, stop_at_step: int | None,
                  skip_doctor: bool, on_update, train_loop, output: ray_output.RunOutput) -> dict[str, Any]:
    import ray

    from trainlift.train.run import raytrainer  # imports Ray Train: not before the CLI has set Ray's auth mode

    started_at = time.time()
    data_cache = prepare_before_ray(spec)
    if on_update is not None:
        on_update({"event": "ray", "address": address or os.environ.get("RAY_ADDRESS")})
    requested = spec.scaling.max_workers or 1
    connected = ensure_ray(address, num_cpus=max(os.cpu_count() or 1, requested * spec.scaling.cpus_per_worker),
                             log_to_driver=ray_output.forwards_worker_lines())
    output.attach_workers()
    raytrainer.start_autoscaling_coordinator()
    try:
        prepared = prepare(spec, started_at, data_cache)
        board = progress.progress_board()
        with progress.following(board, on_update):
            fit(build_trainer(spec, prepared, board, train_loop, stop_at_step, skip_doctor), spec, board, output)
        return summarize(spec, board, prepared, started_at)
    finally:
        if connected:  # stops an embedded Ray; from a cluster it only disconnects
            ray.shutdown()
