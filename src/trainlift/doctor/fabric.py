"""Time collectives across Ray Train workers and judge the bandwidth.

`bench_worker` runs inside every Ray Train worker (gloo on CPU, NCCL on GPU);
`run_fabric` drives it with a TorchTrainer; `fabric_findings` is pure.

Sizes follow nccl-tests: for all_gather the size is the gathered output, for
reduce_scatter the input being reduced, so every op moves the same buffer.
algbw = size / time (GB/s, 1e9 bytes); busbw = algbw * 2(n-1)/n for
all_reduce and algbw * (n-1)/n for all_gather and reduce_scatter.
"""

from __future__ import annotations

import re
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from trainlift.doctor.nccl_log import LogVerdict, classify_log_text, nccl_log_env
from trainlift.doctor.probe import own_nccl_log
from trainlift.doctor.rules import Finding
from trainlift.errors import TrainliftError, UsageError

OPS = ("all_reduce", "all_gather", "reduce_scatter")
DEFAULT_SIZES = "1M,16M,128M"
NATIVE = "native"
EMULATED_RS = "emulated: reduce + scatter"
_UNITS = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3}


def busbw_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    raise ValueError(f"unknown collective {op!r}")


def parse_sizes(text: str) -> list[int]:
    """'1M,16M,128M' -> bytes (binary units, as nccl-tests reads -b/-e)."""
    sizes = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        match = re.fullmatch(r"(\d+)\s*([KMG]?)B?", part.upper())
        if not match or int(match.group(1)) == 0:
            raise UsageError(f"--sizes: {part!r} is not a size", hint="use e.g. 1M,16M,128M (K, M, G are powers of 1024)")
        sizes.append(int(match.group(1)) * _UNITS[match.group(2)])
    if not sizes:
        raise UsageError("--sizes is empty", hint="use e.g. 1M,16M,128M")
    return sizes


@dataclass
class FabricRow:
    op: str
    bytes: int
    world_size: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    method: str = NATIVE


@dataclass
class FabricResult:
    backend: str
    world_size: int
    rows: list[FabricRow]
    nccl_log: LogVerdict | None = None
    findings: list[Finding] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend, "world_size": self.world_size,
            "rows": [asdict(r) for r in self.rows],
            "nccl_log": self.nccl_log.to_dict() if self.nccl_log else None,
            "findings": [f.to_dict() for f in self.findings],
        }


# --- inside each Ray Train worker


def bench_worker(config: dict) -> None:
    """train_loop_per_worker: time each op and size, report rows (and NCCL logs) from rank 0."""
    import ray
    import torch
    import torch.distributed as dist

    from ray.train.torch import get_device

    backend = dist.get_backend()
    device = get_device() if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # all_gather_object over NCCL uses the current device
    rows = []
    for op in config["ops"]:
        for size in config["sizes"]:
            rows.append(asdict(_time_op(op, size, device, config["iters"], config["warmup"])))
    logs = own_nccl_log(config.get("nccl_log_prefix"))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, logs)
    if dist.get_rank() == 0:
        # Train V2 keeps only metrics attached to checkpoints, so results travel through an actor.
        payload = {"rows": rows, "nccl_logs": gathered, "backend": backend, "world_size": dist.get_world_size()}
        ray.get(config["sink"].put.remote(payload))
    dist.barrier()


class _Sink:
    def __init__(self) -> None:
        self.payload: dict | None = None

    def put(self, payload: dict) -> None:
        self.payload = payload

    def get(self) -> dict | None:
        return self.payload


def _time_op(op: str, size: int, device: Any, iters: int, warmup: int) -> FabricRow:
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    numel = max(n, (size // 4) // n * n)
    full = torch.ones(numel, dtype=torch.float32, device=device)
    part = torch.ones(numel // n, dtype=torch.float32, device=device)
    method = NATIVE

    def once() -> None:
        nonlocal method
        if op == "all_reduce":
            dist.all_reduce(full)
        elif op == "all_gather":
            _all_gather(full, part)
        elif method == NATIVE:
            try:
                _reduce_scatter(part, full)
            except (RuntimeError, NotImplementedError, ValueError, AttributeError):
                method = EMULATED_RS
                reduce_scatter_emulated(part, full)
        else:
            reduce_scatter_emulated(part, full)

    for _ in range(warmup):
        once()
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        once()
    _sync(device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    seconds = float(elapsed.item()) / iters
    nbytes = numel * 4
    algbw = nbytes / seconds / 1e9
    return FabricRow(op, nbytes, n, seconds * 1e6, algbw, algbw * busbw_factor(op, n), method)


def _all_gather(out: Any, inp: Any) -> None:
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp)


def _reduce_scatter(out: Any, inp: Any) -> None:
    import torch.distributed as dist

    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp)


def reduce_scatter_emulated(out: Any, inp: Any) -> None:
    """reduce_scatter for backends without it: sum onto rank 0, then scatter the chunks.

    Same result as a reduce_scatter, but rank 0 receives (n-1) full buffers
    instead of a ring's (n-1)/n, so its busbw understates the fabric; rows
    timed this way are labelled.
    """
    import torch.distributed as dist

    total = inp.clone()
    dist.reduce(total, dst=0, op=dist.ReduceOp.SUM)
    chunks = list(total.chunk(dist.get_world_size())) if dist.get_rank() == 0 else None
    dist.scatter(out, scatter_list=chunks, src=0)


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- on the driver


def run_fabric(
    workers: int = 2, sizes: list[int] | None = None, ops: tuple[str, ...] = OPS, use_gpu: bool | None = None,
    iters: int | None = None, warmup: int = 2,
) -> FabricResult:
    """Run the sweep with a TorchTrainer on the connected (or a new local) Ray cluster."""
    import ray
    from ray.train import RunConfig, ScalingConfig

    from trainlift.train.run.raytrainer import torch_trainer

    if workers < 1:
        raise UsageError("--workers must be at least 1")
    sizes = sizes or parse_sizes(DEFAULT_SIZES)
    if use_gpu is None:
        use_gpu = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= workers
    run_id = uuid.uuid4().hex[:8]
    env: dict[str, str] = {}
    log_prefix = None
    if use_gpu:
        log_prefix = f"/tmp/trainlift-nccl-{run_id}"
        env = nccl_log_env(log_prefix)
    sink = ray.remote(num_cpus=0)(_Sink).remote()
    config = {
        "ops": list(ops), "sizes": sizes, "iters": iters or (20 if use_gpu else 5), "warmup": warmup,
        "nccl_log_prefix": log_prefix, "sink": sink,
    }
    with tempfile.TemporaryDirectory(prefix="trainlift-fabric-") as storage:
        trainer = torch_trainer(
            bench_worker,
            use_gpu=use_gpu,
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu),
            run_config=RunConfig(name=f"fabric-{run_id}", storage_path=storage, worker_runtime_env={"env_vars": env}),
        )
        try:
            trainer.fit()
            metrics = ray.get(sink.get.remote())
        except Exception as exc:  # Ray wraps worker failures in its own error types
            from trainlift.train.run.failures import root_cause

            raise TrainliftError(f"the fabric run failed: {root_cause(exc)}",
                                 hint="rerun with --debug for the traceback") from exc
        finally:
            ray.kill(sink)
    if metrics is None:
        raise TrainliftError("the fabric run finished without results from rank 0")
    rows = [FabricRow(**row) for row in metrics["rows"]]
    logs = "".join(text for text in metrics.get("nccl_logs") or [] if text)
    verdict = classify_log_text(logs, source="fabric run") if metrics["backend"] == "nccl" else None
    return FabricResult(metrics["backend"], metrics["world_size"], rows, verdict)


def fabric_findings(
    result: FabricResult, instance_type: str | None, floor_gbps: float | None, efa_interfaces: int = 0,
    floor_from: str | None = None,
) -> list[Finding]:
    """Judge a sweep: largest all_reduce against the floor (the instance type's, or `floor_from` names where it
    came from), and the transport NCCL logged."""
    findings = []
    floor_name = f"{floor_from or instance_type} floor"
    big = max((r for r in result.rows if r.op == "all_reduce"), key=lambda r: r.bytes, default=None)
    if big is None:
        pass
    elif result.world_size < 2:
        findings.append(Finding("fabric_floor", "warning", "one worker: bus bandwidth is 0 by definition", "use --workers 2 or more"))
    elif floor_gbps is None:
        findings.append(Finding(
            "fabric_floor", "ok",
            f"all_reduce busbw {big.busbw_gbps:.2f} GB/s at {_human(big.bytes)} ({result.backend}); no floor to compare",
            "pass --instance-type to compare with the catalog floor, or --floor-gbps",
        ))
    elif big.busbw_gbps < floor_gbps:
        findings.append(Finding(
            "fabric_floor", "error",
            f"all_reduce busbw {big.busbw_gbps:.2f} GB/s at {_human(big.bytes)} is below the {floor_name} "
            f"{floor_gbps:g} GB/s: likely a TCP fallback or a degraded link",
            "check the NCCL transport (trainlift doctor nccl-log), NCCL_NET and the EFA device in each pod",
        ))
    else:
        findings.append(Finding(
            "fabric_floor", "ok",
            f"all_reduce busbw {big.busbw_gbps:.2f} GB/s at {_human(big.bytes)} meets the {floor_name} {floor_gbps:g} GB/s",
        ))
    if any(r.method != NATIVE for r in result.rows):
        findings.append(Finding("fabric_method", "warning", f"reduce_scatter timed as {EMULATED_RS} (no native op on {result.backend})"))
    if result.nccl_log is not None:
        transport = result.nccl_log.transport
        if efa_interfaces and transport in ("socket", "none", "unknown"):
            findings.append(Finding(
                "fabric_transport", "error", f"NCCL used {transport} on an EFA instance ({instance_type})",
                "see the evidence lines: a failed plugin load falls back to sockets",
            ))
        else:
            gdr = {True: ", GPUDirect RDMA", False: ", no GPUDirect RDMA", None: ""}[result.nccl_log.gdrdma]
            findings.append(Finding("fabric_transport", "ok", f"NCCL transport: {transport}{gdr}"))
    return findings


def _human(n: int) -> str:
    for unit, scale in (("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"
