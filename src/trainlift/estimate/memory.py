"""Memory per worker (a GPU's, or a CPU worker's host memory) of the training recipe, item by item.

The recipe keeps fp32 master weights, fp32 gradients and AdamW's two fp32 moments, sharded over the workers
(FSDP2), or over one shard group of an HSDP mesh; it computes in bf16 on GPUs and fp32 on CPUs. Activations are the tensors autograd saves per token of
a decoder layer (checked on the CPU against the peak of a real forward and backward: docs/BENCHMARKS.md
benchmark 15); a checkpointed layer keeps only its input (and, keeping matmuls, their outputs). The peak of a step is at the start of the backward pass: every layer's activations, the loss's
logits chunk and the LM head's gradient are held then; the sharded gradients of the previous step were freed
(`zero_grad(set_to_none=True)`) and this step's grow while the activations shrink, so the total counts the
larger of the two unless gradient accumulation keeps gradients across micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from trainlift.estimate.assumptions import figure
from trainlift.estimate.shape import ModelShape

GIB = 2**30
# The recipe's loss chunks (trainlift.train.model.loss; a unit test keeps these equal to its constants).
CHUNK_ELEMENTS = 2**25
GPU_CHUNK_TOKENS = 1024


@dataclass(frozen=True)
class Workload:
    """What the job asks of each worker: its batch, precision, sharding and what it trains."""

    micro_batch: int
    seq_len: int
    grad_accum: int
    activation_checkpointing: str  # none, full or selective (model.activation_checkpointing; True/False: full/none)
    gpu: bool
    bf16: bool
    workers: int
    lora_params: int = 0
    accum_sync_last: bool = False
    shard: int = 0  # workers each copy of the model is sharded over (HSDP); 0: all of them (plain FSDP)
    checkpoint_every: int = 2  # selective: every Nth layer is checkpointed
    checkpoint_keeps: str = "inputs"  # what a checkpointed layer keeps: inputs, or matmuls (their outputs too)
    compiled: bool = False  # train.compile

    def __post_init__(self) -> None:
        if isinstance(self.activation_checkpointing, bool):
            object.__setattr__(self, "activation_checkpointing", "full" if self.activation_checkpointing else "none")

    def checkpointed_layers(self, layers: int) -> int:
        """How many of the model's `layers` decoder layers are checkpointed (recipe: build.BlockCheckpointing)."""
        if self.activation_checkpointing == "full":
            return layers
        return layers // self.checkpoint_every if self.activation_checkpointing == "selective" else 0

    def last_layer_checkpointed(self, layers: int) -> bool:
        return self.checkpointed_layers(layers) > 0 and (self.activation_checkpointing == "full"
                                                         or layers % self.checkpoint_every == 0)

    def describe_checkpointing(self) -> str:
        """The mode in words, e.g. `selective (1 layer in 2, keeping inputs)`."""
        if self.activation_checkpointing == "none":
            return "none"
        which = "every layer" if self.activation_checkpointing == "full" else f"1 layer in {self.checkpoint_every}"
        return f"{self.activation_checkpointing} ({which}, keeping {self.checkpoint_keeps})"

    @property
    def shard_group(self) -> int:
        return self.shard or self.workers

    @property
    def replicas(self) -> int:
        return self.workers // self.shard_group

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch: rows are packed to seq_len."""
        return self.micro_batch * self.seq_len

    def but(self, **changes) -> "Workload":
        return replace(self, **changes)


def _per_token_layer_bytes(m: ModelShape, b: int) -> int:
    """Bytes autograd saves per token in one decoder layer: two RMSNorms (the fp32 upcast of their input, the
    normalised input and the output), attention (q, k, v, its output and o_proj's contiguous input, the
    log-sum-exp) and the MLP (gate, up, activation and product; two tensors for a plain MLP)."""
    d = m.hidden
    norms = 2 * (4 * d + 2 * b * d)
    attention = b * (3 * m.heads * m.head_dim + 2 * m.kv_heads * m.head_dim) + 4 * m.heads
    if m.moe_layers:
        routed = m.experts_per_token * (4 * m.expert_ffn * b + d * b)
        mlp = routed + 4 * m.shared_expert_ffn * b + 8 * m.experts
    else:
        mlp = (4 if m.gated_mlp else 2) * m.ffn * b
    return norms + attention + mlp


def _per_token_matmul_bytes(m: ModelShape, b: int) -> int:
    """Bytes per token of one decoder layer's matmul and attention-kernel outputs: what a layer checkpointed with
    `keeps: matmuls` saves besides its input (q, k, v, the attention output and its log-sum-exp, o_proj; gate and
    up, or the plain MLP's first linear, and the down projection; an MoE layer's router and its experts')."""
    d = m.hidden
    attention = b * (2 * m.heads * m.head_dim + 2 * m.kv_heads * m.head_dim + d) + 4 * m.heads
    if m.moe_layers:
        mlp = b * (m.experts + m.experts_per_token * (2 * m.expert_ffn + d) + 2 * m.shared_expert_ffn + d)
    else:
        mlp = b * ((2 if m.gated_mlp else 1) * m.ffn + d)
    return attention + mlp


def activation_bytes(m: ModelShape, w: Workload, loss_bytes: float) -> float:
    """What autograd keeps at the start of the backward pass: every un-checkpointed layer's activations, the input
    (and kept matmul outputs) of each checkpointed one, the final norm's, and the CPU's dense attention mask. A
    checkpointed layer's activations exist again while the backward recomputes it; that adds to the peak only for
    the last layer, recomputed once the loss's backward has freed its logits (an earlier one reuses what the
    layers after it freed)."""
    b = 2 if w.bf16 else 4
    layer = _per_token_layer_bytes(m, b) * w.tokens
    matmuls = _per_token_matmul_bytes(m, b) * w.tokens if w.checkpoint_keeps == "matmuls" else 0
    checkpointed = w.checkpointed_layers(m.layers)
    kept = (m.layers - checkpointed) * layer + checkpointed * (b * m.hidden * w.tokens + matmuls)
    final_norm = (4 * m.hidden + 2 * b * m.hidden) * w.tokens
    mask = 0 if w.gpu else w.micro_batch * w.seq_len**2
    recomputed = max(0, layer - matmuls - loss_bytes) if w.last_layer_checkpointed(m.layers) else 0
    return kept + final_norm + mask + recomputed


def loss_chunk_tokens(m: ModelShape, w: Workload) -> int:
    shifted = w.micro_batch * (w.seq_len - 1)
    return min(shifted, GPU_CHUNK_TOKENS if w.gpu else max(1, CHUNK_ELEMENTS // m.vocab))


def memory_items(m: ModelShape, w: Workload, runtime_bytes: float | None = None) -> dict[str, float]:
    """Bytes per worker, item by item, and `total`. `runtime_bytes`: the process's own memory (default: the
    catalog's CUDA context and NCCL buffers on a GPU, the measured Ray worker on a CPU)."""
    b = 2 if w.bf16 else 4
    full = w.lora_params == 0
    trainable = m.params if full else w.lora_params
    frozen_bytes = 0 if full else m.params * b
    items: dict[str, float] = {
        "parameters": (4 * trainable + frozen_bytes) / w.shard_group,
        "gradients": 4 * trainable / (1 if w.accum_sync_last and w.grad_accum > 1 else w.shard_group),
        "optimizer": 8 * trainable / w.shard_group,
    }
    head_grad = b * m.vocab * m.hidden if full else 0
    layer_grad = (m.layer_params if full else w.lora_params // m.layers) * (b + (4 if w.bf16 else 0))
    items["unsharded"] = b * (m.vocab * m.hidden + 2 * m.layer_params) + head_grad + layer_grad

    chunk = loss_chunk_tokens(m, w)
    items["loss"] = chunk * m.vocab * (12 + (2 if w.bf16 else 0))
    items["activations"] = activation_bytes(m, w, items["loss"])
    working = items["unsharded"] + items["loss"] + items["activations"]
    gradients_coexist = w.grad_accum > 1
    allocated = items["parameters"] + items["optimizer"] + (
        working + items["gradients"] if gradients_coexist else max(working, items["gradients"]))
    if runtime_bytes is None:
        runtime_bytes = default_runtime_bytes(w, allocated)
    items["runtime"] = runtime_bytes
    items["total"] = allocated + runtime_bytes
    return items


def model_state_bytes(m: ModelShape, w: Workload) -> float:
    """Parameters, gradients and optimizer state of the whole model, unsharded: what a mesh's shard group splits."""
    items = memory_items(m, w.but(workers=1, shard=0, grad_accum=1), runtime_bytes=0.0)
    return items["parameters"] + items["gradients"] + items["optimizer"]


CHECKPOINT_BYTES_PER_PARAMETER = 12  # a trainable weight in fp32 and its two fp32 AdamW moments


def checkpoint_bytes(m: ModelShape, lora_params: int = 0) -> float:
    """One checkpoint of the whole run: every trainable weight in fp32 and its two AdamW moments (a LoRA run does
    not save its frozen base)."""
    return float(CHECKPOINT_BYTES_PER_PARAMETER * (lora_params or m.params))


def default_runtime_bytes(w: Workload, allocated: float) -> float:
    if not w.gpu:
        return figure("runtime", "cpu_worker_gib").value * GIB
    nccl = figure("runtime", "nccl_gib").value * GIB if w.workers > 1 else 0.0
    return figure("runtime", "cuda_context_gib").value * GIB + nccl + figure("runtime", "allocator_slack").value * allocated


def runtime_sources(gpu: bool) -> list[str]:
    keys = ("cuda_context_gib", "nccl_gib", "allocator_slack") if gpu else ("cpu_worker_gib",)
    return [figure("runtime", key).source for key in keys]
