"""What is checked before training: on the driver before Ray starts (`check`, `check_model_readable_by_workers`;
`check_parallel` once the worker count is known), and on each worker before its first step (`check_stack`, then
`check_transport` after the first collective)."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import pyarrow.fs as pafs

from trainlift.config.job import JobSpec
from trainlift.config.spec_paths import not_a_hub_id
from trainlift.doctor.nccl_log import classify_log_text
from trainlift.doctor.probe import own_nccl_log, probe
from trainlift.doctor.rules import stack_rules
from trainlift.errors import UsageError
from trainlift.train.data import cache as datacache, source as datasource
from trainlift.train.model import fetch
from trainlift.train.run import mesh, trackers


def _local(path: str | None) -> str | None:
    """Absolute form of a local path; URIs pass through."""
    return path if path is None or "://" in path else str(Path(path).expanduser().resolve())


def _local_if_exists(path: str | None) -> str | None:
    """Local paths that exist become absolute; anything else (a hub id, an s3:// URI) passes through."""
    return _local(path) if path is not None and "://" not in path and Path(path).expanduser().exists() else path


def resolve_paths(spec: JobSpec) -> JobSpec:
    """Make local paths absolute: Ray workers do not run in the driver's directory."""
    resolved = spec.model_copy(deep=True)
    model = resolved.model
    model.path = _local(model.path) if model.config is not None else _local_if_exists(model.path)
    model.tokenizer = _local_if_exists(model.tokenizer)
    if isinstance(model.config, str):
        model.config = _local(model.config)
    resolved.data = spec.data.with_locations(_local)
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
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=run_dir)  # a new file: never through a link
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UsageError(f"run.storage: cannot write to {run_dir} ({exc.strerror})",
                         hint="choose a writable directory with --run-dir or --set run.storage=...") from None


def model_config(spec: JobSpec):
    """The model's transformers config: from model.path, model.config, the run's newest checkpoint, or the hub."""
    from transformers import AutoConfig, CONFIG_MAPPING

    from trainlift.train.model.build import build_config

    if spec.model.path and (Path(spec.model.path) / "config.json").exists():
        return AutoConfig.from_pretrained(spec.model.path)
    if spec.model.config is not None:
        return build_config(spec.model.config)
    if (fields := checkpointed_config_fields(spec)) is not None:
        return CONFIG_MAPPING[fields["model_type"]].from_dict(fields)
    if fetch.is_s3(spec.model.path) or spec.model.revision:  # the config and tokenizer files, into the model cache
        return AutoConfig.from_pretrained(fetch.model_dir(spec.model.path, weights=False, revision=spec.model.revision))
    try:
        return AutoConfig.from_pretrained(spec.model.path)
    except (OSError, ValueError) as exc:
        if not_a_hub_id(spec.model.path) and not Path(spec.model.path).expanduser().exists():
            raise UsageError(f"model.path: no model directory at {os.path.normpath(spec.model.path)}",
                             hint="train or download the model it names first (a run's export is "
                                  "<run.storage>/<run.name>/final), or fix the path") from None
        raise UsageError(f"model.path: cannot load a model config from {spec.model.path!r}",
                         hint="give a local model directory, a reachable hub id, or model.config") from exc


def _config_fields(spec: JobSpec) -> dict[str, Any] | None:
    """The model's config as written (config.json, model.config or the run's newest checkpoint), without
    transformers; None for a hub id."""
    own = _own_config_fields(spec)
    return own if own is not None else checkpointed_config_fields(spec)


def _own_config_fields(spec: JobSpec) -> dict[str, Any] | None:
    """The config the spec itself gives (model.path's config.json on this disk, or model.config); None otherwise."""
    if spec.model.path and (Path(spec.model.path) / "config.json").exists():
        return json.loads((Path(spec.model.path) / "config.json").read_text())
    if isinstance(spec.model.config, str):
        return json.loads(Path(spec.model.config).read_text())
    return spec.model.config


def stored_model_limit(spec: JobSpec, limit: int) -> UsageError:
    """seq_len over the positions of the model in the run's stored checkpoint, which this spec does not name
    otherwise (a hub id): that run may hold another model (a rehearsal's toy, another job under the same name),
    so the way out is a run of this job's own, not that model's limit."""
    return UsageError(f"data.seq_len: {spec.data.seq_len} is above the {limit} positions of the model stored in run "
                      f"{spec.run.name} ({spec.run_uri}), whose checkpoint this job would resume",
                      hint=f"if {spec.run_uri} is not this job's run, give this job a new run.name (--set "
                           "run.name=NEW_NAME); to resume that run, keep the data.seq_len it was trained with")


def checkpointed_config_fields(spec: JobSpec) -> dict[str, Any] | None:
    """The model config saved with the run's newest complete checkpoint: a full fine-tune resumes from it alone,
    so model.path may be gone by then."""
    from trainlift.train.run import checkpoint

    try:
        fs, run_path = pafs.FileSystem.from_uri(spec.run_uri)
        latest = checkpoint.latest_complete(fs, run_path)
    except (OSError, ValueError):
        return None
    return checkpoint.model_config_fields(fs, latest[1]) if latest else None


def max_positions(spec: JobSpec) -> int | None:
    fields = _config_fields(spec)
    if fields is not None and (limit := fields.get("max_position_embeddings") or fields.get("n_positions")):
        return limit
    from trainlift.train.model.build import max_positions as of_config  # a default of the model class, or a hub id

    return of_config(model_config(spec))


def check(spec: JobSpec) -> JobSpec:
    """Everything the driver checks before Ray starts; returns the spec with local paths made absolute, or raises one
    clear error. Data files exist and have the format's columns (their rows are checked as the data cache is
    built), seq_len, the attention kernel and LoRA fit the model, trackers are installed and reachable, storage is
    writable."""
    spec = resolve_paths(spec)
    for split in datacache.splits(spec).values():
        datasource.check_schemas(split.sources)
    limit = max_positions(spec)
    if limit is not None and spec.data.seq_len > limit:
        if _own_config_fields(spec) is None and checkpointed_config_fields(spec) is not None:
            raise stored_model_limit(spec, limit)
        raise UsageError(f"data.seq_len: {spec.data.seq_len} is above the model's maximum of {limit} positions",
                         hint=f"--set data.seq_len={limit}")
    from trainlift.train.model import families, kernels

    if (fields := _config_fields(spec)) is not None:  # a hub model's config is checked on the workers
        families.check_loadable(fields)
        kernels.check_spec_choice(spec.model.attn_implementation, spec.model.dtype, fields)
    if spec.model.lora is not None:
        from trainlift.train.model import lora

        lora.validate(model_config(spec), spec.model.lora)
    check_parallel(spec, spec.scaling.max_workers)
    trackers.check(spec)
    check_run_dir(spec)
    return spec


def check_parallel(spec: JobSpec, workers: int | None) -> None:
    """Explicit `parallel` degrees make the run's (max) worker count; None: not known before Ray starts."""
    if workers is not None and (spec.parallel.replicate, spec.parallel.shard) != ("auto", "auto"):
        mesh.explicit_degrees(spec.parallel.replicate, spec.parallel.shard, workers)


def check_model_readable_by_workers(spec: JobSpec, node_ips: set[str], driver_ip: str,
                                    unreadable_on: Callable[[str, set[str]], set[str]] | None = None) -> None:
    """model.config with a local model.path builds the model on the driver's disk: workers on other hosts cannot
    read it there, unless it lies under a local run.storage (which a multi-node run mounts on every node). A local
    model.path that exists must be readable on every other node: `unreadable_on(path, ips)` (default: asked of each
    node through Ray, `nodes_without_model`) names the nodes that cannot; S3 and hub models are fetched per node."""
    model = spec.model
    if not model.path or "://" in model.path:
        return
    others = node_ips - {driver_ip}
    if not others:
        return
    if not spec.is_remote_storage and Path(model.path).is_relative_to(spec.run.storage):
        return
    if model.config is not None:
        raise UsageError(f"model.path: {model.path} would be built on this machine's disk, which workers on "
                         f"{len(others)} other node(s) cannot read",
                         hint="drop model.path (each worker builds the same model from model.config and "
                         "train.seed) or put it under a run.storage volume that every node mounts")
    if not Path(model.path).expanduser().is_dir():  # a hub id: every node fetches it
        return
    blind = (unreadable_on or nodes_without_model)(model.path, others)
    if blind:
        raise UsageError(f"model.path: {model.path} is a directory on this machine's disk, which workers on "
                         f"{len(blind)} other node(s) cannot read ({', '.join(sorted(blind))})",
                         hint="put the model on S3 (model.path: s3://bucket/prefix, fetched once per node) or on "
                         "storage every node mounts at the same path (e.g. under a shared run.storage)")


def nodes_without_model(path: str, ips: set[str]) -> set[str]:
    """The Ray nodes among `ips` that answer that `path`/config.json is not there (a shared file system mounted at
    the same path passes). Nodes Ray does not list, or that do not answer in time, are not named: their workers
    then report the missing files themselves."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not ray.is_initialized():
        return set()

    @ray.remote(num_cpus=0, max_retries=0)
    def has_config(directory: str) -> bool:
        return Path(directory, "config.json").is_file()

    asked = {n["NodeManagerAddress"]: has_config.options(
                 scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(path)
             for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] in ips}
    ready, _ = ray.wait(list(asked.values()), num_returns=len(asked), timeout=120)
    answered = {ip for ip, ref in asked.items() if ref in ready}
    return {ip for ip in answered if not ray.get(asked[ip])}


def check_staging_space(spec: JobSpec, free_bytes: int | None = None) -> None:
    """Two checkpoints of a full fine-tune must fit the staging directory's free space, when every worker stages
    on this machine (a cluster's staging volumes are checked against their rendered size by `submit --cluster`).
    The model's size comes from its safetensors headers; a LoRA checkpoint holds only its adapters."""
    import shutil

    from trainlift.estimate.memory import CHECKPOINT_BYTES_PER_PARAMETER
    from trainlift.train.model.fetch import STAGING_ENV, staging_root

    if not spec.checkpoint.every_steps or spec.model.lora is not None:
        return
    params = stored_parameters(spec.model.path)
    if params is None:
        return
    need = 2 * CHECKPOINT_BYTES_PER_PARAMETER * params
    root = staging_root()
    free = shutil.disk_usage(root).free if free_bytes is None else free_bytes
    if need > free:
        raise UsageError(f"checkpoint staging: two checkpoints of this model take {need / 2**30:.1f} GiB, but {root} "
                         f"has {free / 2**30:.1f} GiB free",
                         hint=f"free space there, or point {STAGING_ENV} at a directory with room")


def stored_parameters(model_path: str | None) -> int | None:
    """Elements in the safetensors files of a local model directory, from their headers alone; None elsewhere."""
    import struct

    if not model_path or "://" in model_path or not Path(model_path).is_dir():
        return None
    total = 0
    for file in Path(model_path).glob("*.safetensors"):
        with open(file, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        total += sum(math.prod(entry["shape"]) for key, entry in header.items() if key != "__metadata__")
    return total or None


class PreflightError(RuntimeError):
    """The worker's environment cannot run this job as specified."""


def check_stack(expect_fabric: str) -> None:
    errors = [f for f in stack_rules(probe(), expect_fabric) if f.severity == "error"]
    if errors:
        details = "; ".join(" ".join((f.message + (f" (fix: {f.fix})" if f.fix else "")).split()) for f in errors)
        raise PreflightError(f"trainlift doctor found {len(errors)} error(s) on this worker: {details}; "
                             "rerun with --skip-doctor to train anyway")


def check_transport(log_prefix: str | None, expect_fabric: str) -> str:
    """Classify this worker's NCCL log after the first collective; EFA expected but not used is fatal."""
    verdict = classify_log_text(own_nccl_log(log_prefix))
    if expect_fabric == "efa" and verdict.transport != "efa":
        evidence = " | ".join(verdict.evidence[:2]) or "no NET lines in the NCCL log"
        raise PreflightError(f"NCCL chose the {verdict.transport} transport, not EFA ({evidence}); "
                             "check the EFA device, the aws-ofi-nccl plugin and NCCL_NET (trainlift doctor)")
    return verdict.transport
