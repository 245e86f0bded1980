"""The mesh a run trains on: plain FSDP over every worker, or HSDP (`replicate` copies, each sharded over `shard`
workers; FSDP2 with a 2-D mesh whose dim 0 replicates and dim 1 shards).

`parallel: auto` shards within a node and replicates across nodes when the sharded state (fp32 parameters,
gradients and AdamW's moments: the memory estimate's `parameters`, `gradients` and `optimizer` items) sharded
over one node's workers takes at most FIT_FRACTION of a worker's memory; otherwise, on one node, on nodes with
different worker counts, or for a model the estimate cannot size, it is plain FSDP over every worker.

Where the workers sit is known only once Ray has placed them: every worker gathers all workers' Ray node ids
(one all-gather) and applies the same pure rule, so every rank agrees. An elastic run that lost workers
(`scaling.workers: [min, max]`) keeps explicit degrees only while they still fit; otherwise it falls back to
plain FSDP over the workers it has, and the start line says so.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

from trainlift.errors import SpecError
from trainlift.estimate.memory import Workload, model_state_bytes
from trainlift.estimate.shape import shape_of

FIT_FRACTION = 0.5  # the rest of a worker's memory is left to activations, gathered layers and the runtime


class MeshError(SpecError):
    """`parallel` degrees that cannot be laid over the workers."""


@dataclass(frozen=True)
class Mesh:
    replicate: int
    shard: int
    why: str = ""

    @property
    def shape(self) -> tuple[int, int]:
        return self.replicate, self.shard

    def as_dict(self) -> dict:
        return {"replicate": self.replicate, "shard": self.shard, "why": self.why}


def workers_per_node(nodes: Sequence) -> int | None:
    """Workers on each node (`nodes`: each rank's node, in rank order) when every node holds as many and a node's
    ranks are consecutive (a shard group of the mesh is a run of consecutive ranks); None otherwise."""
    runs = [len(list(group)) for _, group in itertools.groupby(nodes)]
    if len(runs) != len(set(nodes)) or len(set(runs)) != 1:
        return None
    return runs[0]


def explicit_degrees(replicate: int | str, shard: int | str, world: int) -> tuple[int, int]:
    """The degrees `parallel` gives for `world` workers (one `auto` is filled in); raises MeshError when they do
    not make `world`. Both `auto`: not explicit (ValueError)."""
    if replicate == shard == "auto":
        raise ValueError("both degrees are auto")
    if replicate != "auto" and shard != "auto":
        if replicate * shard != world:
            raise MeshError(f"parallel: replicate {replicate} × shard {shard} = {replicate * shard} workers, but "
                            f"the run has {world}", hint="make their product the worker count, or set one to auto")
        return replicate, shard
    given, name = (replicate, "replicate") if shard == "auto" else (shard, "shard")
    if world % given:
        raise MeshError(f"parallel.{name}: {given} does not divide the run's {world} workers",
                        hint=f"use a divisor of {world}, or auto")
    return (given, world // given) if name == "replicate" else (world // given, given)


def choose_mesh(replicate: int | str, shard: int | str, nodes: Sequence, state_bytes: float | None,
                worker_bytes: float, shrunk: bool = False) -> Mesh:
    """The mesh for workers on `nodes` (each rank's node, in rank order). `state_bytes`: the sharded state's
    whole size (None: unknown); `worker_bytes`: one worker's memory; `shrunk`: an elastic run below its max
    workers, where degrees that no longer fit fall back to plain FSDP instead of failing."""
    world, per_node = len(nodes), workers_per_node(nodes)
    if (replicate, shard) != ("auto", "auto"):
        try:
            r, s = explicit_degrees(replicate, shard, world)
            if r > 1 and (per_node is None or per_node % s):
                layout = f"{per_node} per node" if per_node else "an uneven number per node"
                raise MeshError(f"parallel.shard: {s} does not divide the workers of a node ({layout})",
                                hint="give shard a divisor of the workers per node, or set parallel to auto")
        except MeshError as exc:
            if not shrunk:
                raise
            return Mesh(1, world, f"plain FSDP: {replicate} × {shard} does not fit the {world} workers left "
                                  f"({exc.message})")
        return Mesh(r, s, "as parallel says")
    if per_node is None:
        return Mesh(1, world, "plain FSDP: nodes hold different numbers of workers (or not consecutive ranks)")
    if per_node == world:
        return Mesh(1, world, "plain FSDP: one node")
    if state_bytes is None:
        return Mesh(1, world, "plain FSDP: the estimate cannot size this model")
    if state_bytes / per_node > FIT_FRACTION * worker_bytes:
        return Mesh(1, world, "plain FSDP: the sharded state does not fit one node")
    return Mesh(world // per_node, per_node, "shard within a node, replicate across nodes")


def state_bytes(config, spec, gpu: bool, bf16: bool, lora_params: int = 0) -> float | None:
    """Parameters, gradients and optimizer state of the whole model (unsharded), from the memory estimate;
    None for a model the estimate cannot size."""
    try:
        shape = shape_of(config)
    except SpecError:
        return None
    work = Workload(micro_batch=spec.train.micro_batch_size, seq_len=spec.data.seq_len, grad_accum=1,
                    activation_checkpointing="none", gpu=gpu, bf16=bf16, workers=1, lora_params=lora_params)
    return float(model_state_bytes(shape, work))


def agree(spec, w, config, lora_params: int = 0) -> Mesh:
    """The mesh every worker of the group chooses alike: one all-gather of the workers' Ray node ids (a raylet
    is a node: Ray Train's own node rank goes by IP address, one for all raylets of a host), then
    `choose_mesh`. `w` is the recipe's Worker, `config` the model's transformers config."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor([node_key()], dtype=torch.int64, device=w.device)
    gathered = [torch.zeros_like(mine) for _ in range(w.world)]
    dist.all_gather(gathered, mine)
    nodes = [int(t.item()) for t in gathered]
    shrunk = spec.scaling.elastic and w.world < spec.scaling.max_workers
    return choose_mesh(spec.parallel.replicate, spec.parallel.shard, nodes,
                       state_bytes(config, spec, w.device.type == "cuda", w.bf16, lora_params),
                       worker_memory(w.device, nodes.count(int(mine.item()))), shrunk)


def node_key() -> int:
    """This worker's Ray node as an int64 (60 bits of its random node id); outside Ray, 0 (one node)."""
    try:
        import ray

        return int(ray.get_runtime_context().get_node_id()[:15], 16) if ray.is_initialized() else 0
    except Exception:  # noqa: BLE001 - no runtime context here
        return 0


def worker_memory(device, local_workers: int) -> float:
    """One worker's memory: its GPU's, or on a CPU its share of the host's."""
    import torch

    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    import psutil

    return psutil.virtual_memory().total / max(1, local_workers)
