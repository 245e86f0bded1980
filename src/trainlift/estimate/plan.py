"""A job on a target (N instances of a type, or this machine's CPUs): does it fit, how long, what it costs,
and when it does not fit, the changes that would make it fit."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainlift.catalog import InstanceProfile
from trainlift.config.job import JobSpec
from trainlift.errors import SpecError
from trainlift.estimate import assumptions
from trainlift.estimate.memory import GIB, Workload, checkpoint_bytes, memory_items, model_state_bytes, runtime_sources
from trainlift.estimate.shape import ModelShape
from trainlift.estimate.timing import Fabric, Timing, reference_pass_s, step_timing
from trainlift.train.run.mesh import Mesh, choose_mesh

MAX_NODES = 64
ADVICE_LORA_RANK = 16


@dataclass(frozen=True)
class Target:
    """`nodes` instances of `instance`, with their price; or this machine (instance None), whose memory the
    workers share."""

    instance: InstanceProfile | None
    nodes: int = 1
    host_memory_bytes: float = 0.0
    usd_per_hour: float | None = None
    price_source: str | None = None

    @property
    def gpus(self) -> int:
        return self.nodes * self.instance.gpus if self.instance else 0

    def describe(self) -> str:
        if self.instance is None:
            return "this machine (CPU)"
        return f"{self.nodes}x {self.instance.instance_type} ({self.gpus}x {self.instance.gpu_model})"

    def with_nodes(self, nodes: int) -> "Target":
        per_node = self.usd_per_hour / self.nodes if self.usd_per_hour is not None else None
        return Target(self.instance, nodes, self.host_memory_bytes,
                      per_node * nodes if per_node is not None else None, self.price_source)


@dataclass(frozen=True)
class Advice:
    change: str
    per_gpu_bytes: float
    fits: bool
    usd_per_hour: float | None
    hours: float | None  # billed: training and the nodes' start

    def to_dict(self) -> dict[str, Any]:
        return {"change": self.change, "per_gpu_gib": round(self.per_gpu_bytes / GIB, 2), "fits": self.fits,
                "usd_per_hour": _round(self.usd_per_hour), "hours": _round(self.hours, 3)}


@dataclass(frozen=True)
class Estimate:
    job: JobSpec
    target: Target
    workload: Workload
    items: dict[str, float]
    capacity_bytes: float
    timing: Timing | None
    fabric: Fabric | None
    hfu: assumptions.Figure | None
    mesh: Mesh | None = None
    advice: list[Advice] = field(default_factory=list)
    checkpoint_bytes: float = 0.0  # one checkpoint of the whole run
    model_params: int = 0
    # DPO: the reference pass, once per run, over as many tokens as the run trains on (it scores the preference
    # data once: fewer tokens for a run of several epochs, more for one of less than an epoch)
    reference_s: float | None = None

    @property
    def fits(self) -> bool:
        return self.items["total"] <= self.capacity_bytes

    @property
    def checkpoint_bytes_per_node(self) -> float:
        """The busiest node's part of one checkpoint: each worker writes its shard."""
        per_node = min(self.target.instance.gpus, self.workload.workers) if self.target.instance else self.workload.workers
        return self.checkpoint_bytes * per_node / self.workload.workers

    @property
    def staging_bytes(self) -> float | None:
        """A GPU node's rendered staging volume (render.raycluster); None on this machine."""
        from trainlift.render.raycluster import staging_gib

        return staging_gib(self.target.instance) * GIB if self.target.instance else None

    @property
    def staging_fits(self) -> bool:
        """Two checkpoints fit a node's staging volume (a save in flight and the next)."""
        return self.staging_bytes is None or 2 * self.checkpoint_bytes_per_node <= self.staging_bytes

    @property
    def mfu(self) -> float | None:
        """The model FLOP utilisation the assumed HFU implies: model FLOPs over executed FLOPs, times the HFU."""
        if self.timing is None or self.hfu is None:
            return None
        return self.hfu.value * self.timing.flops_per_token / self.timing.hardware_flops_per_token

    @property
    def hours(self) -> float | None:
        if not self.timing:
            return None
        return (self.timing.step_s * self.job.train.steps + (self.reference_s or 0.0)) / 3600

    @property
    def start_s(self) -> dict[str, float] | None:
        """On GPU nodes launched for the job, what comes before its first step (assumptions, catalog/estimate.yaml
        cold_start); None on this machine."""
        if not self.workload.gpu:
            return None
        figures = {k: assumptions.figure("cold_start", k).value for k in ("node_start_s", "image_pull_s",
                                                                          "staging_gbps")}
        weights_bytes = 2 * self.model_params  # bf16, as the hub and `trainlift export` hold them
        return {"node": figures["node_start_s"], "image_pull": figures["image_pull_s"],
                "model_staging": weights_bytes * 8 / (figures["staging_gbps"] * 1e9)}

    @property
    def start_hours(self) -> float:
        return sum((self.start_s or {}).values()) / 3600

    @property
    def usd_total(self) -> float | None:
        """Training and the nodes' start: both are billed."""
        if self.hours is None or self.target.usd_per_hour is None:
            return None
        return (self.hours + self.start_hours) * self.target.usd_per_hour

    def to_dict(self) -> dict[str, Any]:
        t = self.timing
        return {
            "fits": self.fits, "target": self.target.describe(), "device": "cuda" if self.workload.gpu else "cpu",
            "workers": self.workload.workers,
            "activation_checkpointing": self.workload.describe_checkpointing(), "compile": self.workload.compiled,
            "mesh": self.mesh.as_dict() if self.mesh else None,
            "per_gpu_gib": {key: round(value / GIB, 3) for key, value in self.items.items()},
            "gpu_gib": round(self.capacity_bytes / GIB, 2) if self.workload.gpu else None,
            "host_gib_per_worker": None if self.workload.gpu else round(self.capacity_bytes / GIB, 2),
            "runtime_gib": round(self.items["runtime"] / GIB, 3),
            "runtime_sources": runtime_sources(self.workload.gpu),
            "flops_per_token": t.flops_per_token if t else None,
            "hfu": self.hfu.value if self.hfu else None, "hfu_source": self.hfu.source if self.hfu else None,
            "hfu_basis": self.hfu.label if self.hfu else None, "mfu": _round(self.mfu, 4),
            "hardware_flops_per_token": t.hardware_flops_per_token if t else None,
            "compute_s": _round(t and t.compute_s, 4), "comm_s": _round(t and t.comm_s, 4),
            "step_s": _round(t and t.step_s, 4), "reference_pass_s": _round(self.reference_s, 1),
            "tokens_per_s_per_gpu": _round(t and t.tokens_per_s_per_gpu, 1),
            "hours": _round(self.hours, 3), "usd_per_hour": _round(self.target.usd_per_hour),
            "start_s": {k: round(v, 1) for k, v in self.start_s.items()} if self.start_s else None,
            "usd_total": _round(self.usd_total), "price_source": self.target.price_source,
            "advice": [a.to_dict() for a in self.advice],
            "checkpoint_gib_per_node": round(self.checkpoint_bytes_per_node / GIB, 2),
            "staging_gib": round(self.staging_bytes / GIB, 1) if self.staging_bytes is not None else None,
            "staging_fits": self.staging_fits,
        }


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def mesh_for(job: JobSpec, shape: ModelShape, target: Target, w: Workload, capacity: float) -> Mesh:
    """The mesh the recipe would choose (`train.run.mesh`), workers filling the nodes in order."""
    per_node = target.instance.gpus if target.instance else w.workers
    nodes = [rank // per_node for rank in range(w.workers)]
    return choose_mesh(job.parallel.replicate, job.parallel.shard, nodes, model_state_bytes(shape, w), capacity)


def workload_for(job: JobSpec, shape: ModelShape, target: Target) -> Workload:
    gpu = target.instance is not None
    workers = job.scaling.max_workers or target.gpus or 1
    if gpu and workers > target.gpus:
        raise SpecError(f"the job asks for {workers} workers but {target.describe()} has {target.gpus} GPUs",
                        hint="add nodes (--nodes) or set scaling.workers: auto")
    lora = job.model.lora
    bf16 = job.model.dtype == "bf16" or (job.model.dtype == "auto" and gpu)
    accum_last = job.train.accum_sync == "last" or (job.train.accum_sync == "auto" and not gpu)
    return Workload(
        micro_batch=job.train.micro_batch_size, seq_len=job.data.seq_len, grad_accum=job.train.grad_accum,
        activation_checkpointing=job.model.activation_checkpointing, gpu=gpu, bf16=bf16, workers=workers,
        lora_params=shape.lora_params(lora.r, lora.target_modules) if lora else 0, accum_sync_last=accum_last,
        checkpoint_every=job.model.activation_checkpointing_every,
        checkpoint_keeps=job.model.activation_checkpointing_keeps, compiled=job.train.compile)


def _fabric(target: Target, w: Workload) -> tuple[Fabric, assumptions.Figure]:
    profile = target.instance
    node_link = assumptions.figure("node_link_gbps", profile.gpu_model)
    # The catalog's floor is half of the published or line-rate 2-node all_reduce bus bandwidth.
    network = 2 * (profile.busbw_floor_gbps or profile.network_gbps / 16)
    within_node = node_link.value if node_link else profile.network_gbps / 8
    shard_busbw = within_node if w.shard_group <= profile.gpus else network
    hfu, measured = assumptions.hfu(profile.gpu_model)
    if w.compiled and not measured:
        hfu = assumptions.compiled(hfu)
    return Fabric(profile.peak_bf16_flops_per_gpu, hfu.value, shard_busbw, network), hfu


def plan(job: JobSpec, shape: ModelShape, target: Target, *, advise: bool = True) -> Estimate:
    w = workload_for(job, shape, target)
    mesh = mesh_for(job, shape, target, w, _capacity(target, w))
    return _estimate(job, shape, target, w.but(shard=mesh.shard), advise, mesh)


def _capacity(target: Target, w: Workload) -> float:
    if target.instance is None:
        return target.host_memory_bytes / w.workers
    return target.instance.gpu_memory_mib * 2**20


def _estimate(job: JobSpec, shape: ModelShape, target: Target, w: Workload, advise: bool,
              mesh: Mesh | None = None) -> Estimate:
    items, capacity = memory_items(shape, w), _capacity(target, w)
    timing, fabric, hfu = None, None, None
    if target.instance is not None:
        fabric, hfu = _fabric(target, w)
        timing = step_timing(shape, w, fabric)
    reference = None
    if timing is not None and job.train.objective == "dpo":
        step_tokens = timing.tokens_per_s_per_gpu * timing.step_s * w.workers
        reference = reference_pass_s(shape, w, fabric, step_tokens * job.train.steps)
    advice = _advice(job, shape, target, w) if advise and items["total"] > capacity else []
    return Estimate(job, target, w, items, capacity, timing, fabric, hfu, mesh, advice,
                    checkpoint_bytes(shape, w.lora_params), shape.params, reference)


def _advice(job: JobSpec, shape: ModelShape, target: Target, w: Workload) -> list[Advice]:
    """The changes that would make the job fit, cheapest run first; unfitting ones only when none fits."""
    options: list[tuple[str, Target, Workload]] = []
    if w.replicas > 1:
        options.append(("parallel.replicate: 1 (plain FSDP: every worker shards the model)", target, w.but(shard=0)))
    options.extend(_checkpointing(shape, target, w))
    if w.micro_batch > 1:
        options.append((f"train.micro_batch_size: 1, train.grad_accum: {w.grad_accum * w.micro_batch} (same batch)",
                        target, w.but(micro_batch=1, grad_accum=w.grad_accum * w.micro_batch)))
    if not w.lora_params:
        lora = shape.lora_params(ADVICE_LORA_RANK, "all-linear")
        options.append((f"model.lora: {{r: {ADVICE_LORA_RANK}}} (adapters instead of every weight)", target,
                        w.but(lora_params=lora)))
    if target.instance is not None:
        options.extend(_more_nodes(job, shape, target, w))
    results = []
    for change, where, workload in options:
        e = _estimate(job, shape, where, workload, advise=False)
        hours = None if e.hours is None else e.hours + e.start_hours  # what the option bills, its start included
        results.append(Advice(change, e.items["total"], e.fits, where.usd_per_hour, hours))
    fitting = [a for a in results if a.fits]
    return sorted(fitting or results, key=lambda a: (a.hours is None, (a.hours or 0) * (a.usd_per_hour or 0),
                                                     a.per_gpu_bytes))


def _checkpointing(shape: ModelShape, target: Target, w: Workload) -> list[tuple[str, Target, Workload]]:
    """More activation checkpointing: selective (every `checkpoint_every`-th layer) where it fits, since it
    recomputes less; else full."""
    options = []
    selective = w.but(activation_checkpointing="selective")
    if w.activation_checkpointing == "none" and selective.checkpointed_layers(shape.layers):
        options.append((f"model.activation_checkpointing: selective (1 layer in {w.checkpoint_every})", target,
                        selective))
        if memory_items(shape, selective)["total"] <= _capacity(target, selective):
            return options
    if w.activation_checkpointing != "full":
        options.append(("model.activation_checkpointing: full", target, w.but(activation_checkpointing="full")))
    return options


def _more_nodes(job: JobSpec, shape: ModelShape, target: Target, w: Workload) -> list[tuple[str, Target, Workload]]:
    """The fewest nodes, all GPUs used, on which the job fits as it is, and with full activation checkpointing."""
    found = []
    for workload, suffix in ((w, ""), (w.but(activation_checkpointing="full"), " and activation checkpointing")):
        if suffix and w.activation_checkpointing == "full":
            continue
        for nodes in range(target.nodes + 1, MAX_NODES + 1):
            bigger = target.with_nodes(nodes)
            scaled = workload.but(workers=bigger.gpus, shard=0)
            if memory_items(shape, scaled)["total"] <= target.instance.gpu_memory_mib * 2**20:
                found.append((f"{nodes} nodes ({bigger.gpus} workers){suffix}", bigger, scaled))
                break
    return found
