"""Step time on GPUs: the FLOPs a step executes at an assumed hardware FLOP utilisation (HFU: recomputation
counted, so the figure carries over between activation checkpointing settings), and FSDP's collectives at the
fabric's bandwidth. The model FLOP utilisation (MFU) it implies is model FLOPs over executed FLOPs times the HFU.

FLOPs per token (PaLM appendix B, as torchtitan counts them): 6 per parameter a token goes through (the LM
head's included, the embedding's lookup not), plus 12·L·H·Q·T for attention; a frozen LoRA base costs 4 per
weight (no weight gradient); DPO's reference pass is one forward over the preference data, once per run; activation checkpointing runs each
checkpointed layer's forward twice (keeping
matmul outputs, only its elementwise ops, which count no FLOPs here). FSDP moves per micro-batch the parameters
twice (all-gather in forward and backward) and the gradients once (reduce-scatter, fp32 on GPUs) within a shard
group; HSDP adds an all-reduce of each gradient shard across the replicas. FSDP overlaps them with compute, so a
step takes the longer of the two.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainlift.estimate.memory import Workload
from trainlift.estimate.shape import ModelShape


@dataclass(frozen=True)
class Fabric:
    """What the GPUs compute and move: peak FLOP/s per GPU, the HFU assumed, and the bus bandwidth (GB/s, as
    nccl-tests reports it) of a collective over one shard group, and of one across the replicas (HSDP)."""

    peak_flops: float
    hfu: float
    busbw_gbps: float
    replica_busbw_gbps: float = 0.0


@dataclass(frozen=True)
class Timing:
    flops_per_token: float  # model FLOPs (what MFU counts)
    compute_s: float
    comm_s: float
    step_s: float
    tokens_per_s_per_gpu: float
    hardware_flops_per_token: float = 0.0  # what the GPUs execute (what HFU counts)


def model_flops_per_token(m: ModelShape, w: Workload) -> float:
    attention = 12 * m.layers * m.heads * m.head_dim * w.seq_len
    matmul_params = m.active_decoder_params + m.vocab * m.hidden
    if w.lora_params:
        return 4 * matmul_params + 6 * w.lora_params + attention
    return 6 * matmul_params + attention


def recompute_flops_per_token(m: ModelShape, w: Workload) -> float:
    """The forward of the checkpointed layers again: all of the decoder's under full checkpointing, 1/N of it
    checkpointing every Nth layer; none when they keep their matmul outputs."""
    if w.checkpoint_keeps == "matmuls":
        return 0.0
    decoder_forward = 2 * m.active_decoder_params + 4 * m.layers * m.heads * m.head_dim * w.seq_len
    return decoder_forward * w.checkpointed_layers(m.layers) / m.layers


def forward_flops_per_token(m: ModelShape, w: Workload) -> float:
    """One forward, as DPO's reference pass runs it once over the preference data: 2 per parameter a token goes
    through and the attention's forward (a third of a training step's)."""
    attention = 4 * m.layers * m.heads * m.head_dim * w.seq_len
    return 2 * (m.active_decoder_params + m.vocab * m.hidden + w.lora_params) + attention


def reference_pass_s(m: ModelShape, w: Workload, fabric: Fabric, tokens: float) -> float:
    """DPO's reference log-probs over `tokens` of preference data, every worker scoring its share, at the HFU a
    training step is assumed to reach."""
    return tokens * forward_flops_per_token(m, w) / (fabric.peak_flops * fabric.hfu * w.workers)


def hardware_flops_per_token(m: ModelShape, w: Workload) -> float:
    """What the GPUs execute: the model's FLOPs, the LM head's forward again (the chunked loss recomputes each
    chunk's logits in backward, train/model/loss.py), and the checkpointed layers' forward again."""
    head_again = 2 * m.vocab * m.hidden
    return model_flops_per_token(m, w) + head_again + recompute_flops_per_token(m, w)


def collective_bytes_per_step(m: ModelShape, w: Workload) -> float:
    """Bytes one worker sends (and receives) per step in FSDP's all-gathers and reduce-scatters, within its shard
    group."""
    n = w.shard_group
    if n == 1:
        return 0.0
    b = 2 if w.bf16 else 4
    trainable = m.params if not w.lora_params else w.lora_params
    gathered = 2 * b * (m.params + (w.lora_params or 0))
    reduce_scatters = 1 if w.accum_sync_last else w.grad_accum
    per_step = w.grad_accum * gathered + reduce_scatters * 4 * trainable
    return per_step * (n - 1) / n


def replica_bytes_per_step(m: ModelShape, w: Workload) -> float:
    """Bytes one worker sends per step in HSDP's all-reduce of its gradient shard across the replicas."""
    r = w.replicas
    if r == 1:
        return 0.0
    trainable = m.params if not w.lora_params else w.lora_params
    # Once per step either way: every micro-batch but the last skips it (recipe.accumulate_gradients).
    return 4 * trainable / w.shard_group * 2 * (r - 1) / r


def step_timing(m: ModelShape, w: Workload, fabric: Fabric) -> Timing:
    tokens = w.tokens * w.grad_accum
    compute = tokens * hardware_flops_per_token(m, w) / (fabric.peak_flops * fabric.hfu)
    comm = collective_bytes_per_step(m, w) / (fabric.busbw_gbps * 1e9)
    if w.replicas > 1:
        comm += replica_bytes_per_step(m, w) / (fabric.replica_busbw_gbps * 1e9)
    step = max(compute, comm)
    return Timing(model_flops_per_token(m, w), compute, comm, step, tokens / step, hardware_flops_per_token(m, w))


@dataclass(frozen=True)
class PullPath:
    """How one node pulls an image: the rate a pull unpacks at (GB of image a second, from a measured pull), the
    node's network (Gb/s) and the rate its layers' disk takes writes at (GB/s; None: not the narrower part)."""

    unpack_gb_per_s: float
    network_gbps: float
    disk_gb_per_s: float | None = None


def image_pull_s(image_gb: float, path: PullPath) -> float:
    """An image's first pull on a node (GB of the image unpacked): the slowest of unpacking it at the measured rate,
    fetching it over the node's network and writing it to the layers' disk. estimate's cold start takes the field
    report's pull of the Ray Train DLC, which this model reproduces at the DLC's catalogued size."""
    seconds = [image_gb / path.unpack_gb_per_s, image_gb * 8 / path.network_gbps]
    if path.disk_gb_per_s:
        seconds.append(image_gb / path.disk_gb_per_s)
    return max(seconds)
