"""Load or build a Hugging Face causal LM and shard it with FSDP2 (`fully_shard`)."""

from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from types import MethodType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from trainlift.train.model import fetch, kernels, weights

if TYPE_CHECKING:  # transformers and FSDP2 are imported by the functions that use them
    from transformers import PretrainedConfig


def build_config(config: dict[str, Any] | str, tokenizer=None) -> PretrainedConfig:
    """An HF config from a dict (with model_type) or a config.json path; vocab from the tokenizer if unset."""
    from transformers import AutoConfig

    if isinstance(config, str):
        config = json.loads(Path(config).read_text())
    config = dict(config)
    model_type = config.pop("model_type")
    if tokenizer is not None:
        config.setdefault("vocab_size", len(tokenizer))
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(tokenizer, name) is not None:
                config.setdefault(name, getattr(tokenizer, name))
    return AutoConfig.for_model(model_type, **config)


def materialize(path: str, config: dict[str, Any] | str, tokenizer_path: str, seed: int) -> bool:
    """Build a randomly initialised model from `config` and save it (with its tokenizer) to `path`,
    unless a model is already there. Returns whether it built one."""
    out = Path(path)
    if (out / "config.json").exists():
        return False
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    model = random_model(config, tokenizer, seed)
    hf_logging.disable_progress_bar()  # its "Writing model shards" bar would cut into trainlift's progress lines
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return True


def load_model(model_spec, seed: int) -> torch.nn.Module:
    """The whole model in fp32 on the CPU, unsharded (the training recipe uses `weights` instead)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_spec.path is not None:
        return AutoModelForCausalLM.from_pretrained(model_spec.path, dtype=torch.float32)
    return random_model(model_spec.config, AutoTokenizer.from_pretrained(model_spec.tokenizer), seed)


def random_model(config: dict[str, Any] | str, tokenizer, seed: int) -> torch.nn.Module:
    """The whole model from `config`, initialised as transformers does under `seed`."""
    from transformers import AutoModelForCausalLM

    with weights.cpu_seeded(seed):
        return AutoModelForCausalLM.from_config(build_config(config, tokenizer))


def sharded_config(model_spec) -> PretrainedConfig:
    """The model's config, from `path` (a local directory, hub id or s3:// prefix: fetched once per node) or built
    from `config`."""
    from transformers import AutoTokenizer

    if model_spec.path is not None:
        return weights.config_of(str(fetch.model_dir(model_spec.path, revision=model_spec.revision)))
    return build_config(model_spec.config, AutoTokenizer.from_pretrained(model_spec.tokenizer))


def attention_implementation(choice: str, device: torch.device, config: PretrainedConfig | None = None,
                             bf16: bool = True) -> str:
    """`model.attn_implementation` for `device`, within what the model of `config` supports and bf16 (or fp32)
    compute allows (kernels.py says how auto decides); an explicit choice they do not allow is a UsageError."""
    model = kernels.ModelKernels(half_precision=bf16) if config is None else model_kernels(config, bf16)
    return kernels.attention_choice(choice, device, model).kernel


def model_kernels(config: PretrainedConfig, bf16: bool = True) -> kernels.ModelKernels:
    """The kernels the causal LM class transformers builds for `config` declares."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return kernels.ModelKernels(half_precision=bf16)
    return kernels.of_flags(cls.__name__, {flag: getattr(cls, flag, False) for flag in kernels.SUPPORT_FLAGS.values()},
                            bf16)


def fill_weights(model: torch.nn.Module, model_spec, seed: int, device: torch.device,
                 checkpoint_key: weights.CheckpointKey | None = None) -> torch.nn.Module:
    """Give a sharded meta model (`weights.empty_model` then `apply_fsdp`) its weights: from the safetensors
    files of `path`, else a seeded random init that does not depend on the world size. `checkpoint_key` names
    each parameter as the base model does (None: a parameter the base model lacks, left for the caller)."""
    weights.materialize_shards(model, device)
    checkpoint_key = checkpoint_key or weights.same_key
    if model_spec.path is not None:
        weights.load_safetensors(model, fetch.model_dir(model_spec.path, revision=model_spec.revision), checkpoint_key)
    else:
        weights.init_random(model, seed, checkpoint_key)
    return model


def load_tokenizer(model_spec):
    """From `tokenizer`, else `path`: a local directory, or this node's cache of a hub id or s3:// prefix (the
    tokenizer files alone where the weights are not there)."""
    from transformers import AutoTokenizer

    revision = None if model_spec.tokenizer else model_spec.revision  # a tokenizer of its own is not pinned
    return AutoTokenizer.from_pretrained(str(fetch.model_dir(model_spec.tokenizer or model_spec.path, weights=False,
                                                              revision=revision)))


def max_positions(config: PretrainedConfig) -> int | None:
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks, found by the class names the model itself declares unsplittable; also once sharded
    (`fully_shard` makes each block an instance of a subclass of its class)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if any(cls.__name__ in names for cls in type(m).__mro__)]


def device_mesh(device: torch.device, mesh_shape: tuple[int, int] | None = None):
    """A 1-D mesh over every worker (plain FSDP) or, for (replicate, shard) with replicate > 1, the 2-D mesh of
    HSDP: dim 0 replicates, dim 1 shards (consecutive ranks form a shard group)."""
    from torch.distributed.device_mesh import init_device_mesh

    replicate, shard = mesh_shape or (1, dist.get_world_size())
    if replicate == 1:
        return init_device_mesh(device.type, (shard,))
    return init_device_mesh(device.type, (replicate, shard), mesh_dim_names=("replicate", "shard"))


@dataclass(frozen=True)
class BlockCheckpointing:
    """Which decoder blocks recompute their activations in the backward pass, and what a checkpointed block keeps
    for it (model.activation_checkpointing, _every, _keeps): `mode` none, full (every block) or selective (the
    `every`-th, 2·`every`-th, ... block); `keeps` inputs (the whole block runs again) or matmuls (only its
    elementwise ops run again)."""

    mode: str = "none"
    every: int = 2
    keeps: str = "inputs"

    @classmethod
    def of(cls, model_spec) -> "BlockCheckpointing":
        return cls(model_spec.activation_checkpointing, model_spec.activation_checkpointing_every,
                   model_spec.activation_checkpointing_keeps)

    def covers(self, index: int) -> bool:
        """Whether the block at 0-based `index` is checkpointed."""
        return self.mode == "full" or (self.mode == "selective" and (index + 1) % self.every == 0)


# What `keeps: matmuls` saves: the outputs of the ops that cost FLOPs (matrix multiplications and attention kernels,
# by the names torch dispatches them under); everything else in the block is recomputed.
MATMUL_OPS = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention", "flash_attn::_flash_attn_forward",
    "flash_attn::_flash_attn_varlen_forward", "flex_attention"})


def _save_matmul_outputs(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op.name() in MATMUL_OPS else CheckpointPolicy.PREFER_RECOMPUTE


_KEEP_MATMULS = partial(create_selective_checkpoint_contexts, _save_matmul_outputs)


def _checkpoint_keeping_matmuls(block: torch.nn.Module, *args, **kwargs):
    """The block's forward, checkpointed with its matmul outputs kept. A function of the block (not a closure over
    it), so that one compiled graph serves every block."""
    return checkpoint(type(block).forward, block, *args, use_reentrant=False, context_fn=_KEEP_MATMULS, **kwargs)


def _compiled(forward, around_checkpoint: bool = False):
    compiled = torch.compile(forward)
    if not around_checkpoint:
        return compiled

    def run(*args, **kwargs):
        # Dynamo traces a checkpoint only if its forward has no side effects it would have to replay when the
        # backward recomputes it, unless told it may skip them. HF's attention sets and resets a context variable
        # (the `kernels` package's forward wrapper): a pair that leaves nothing to replay.
        option = "skip_fwd_side_effects_in_bwd_under_checkpoint"  # not in every torch the floor allows
        with torch._dynamo.config.patch(**{option: True}) if hasattr(torch._dynamo.config, option) else nullcontext():
            return compiled(*args, **kwargs)

    return run


def prepare_block(block: torch.nn.Module, keeps: str | None, compile_block: bool) -> None:
    """Make the block's forward checkpointed (keeping `keeps`; None: not checkpointed) and/or compiled, in place:
    its parameters keep their names, so weights, LoRA adapters and checkpoints find them as before. Call before
    `fully_shard`, whose hooks then run eagerly around it. Compiling traces each distinct block once; without
    fullgraph, a block that traces whole is one graph and one with a graph break (flash-attn's variable-length
    set-up reads lengths from the position ids) runs in pieces instead of failing."""
    if keeps is None and not compile_block:
        return
    if keeps == "matmuls":  # compiled around the checkpoint: the compiler sees which outputs to keep
        forward = MethodType(_checkpoint_keeping_matmuls, block)
        block.forward = _compiled(forward, around_checkpoint=True) if compile_block else forward
    else:
        forward = _compiled(block.forward) if compile_block else block.forward
        # around the compiled code, so that a graph break inside does not undo compiling
        block.forward = partial(checkpoint, forward, use_reentrant=False) if keeps == "inputs" else forward
    if keeps is not None:
        block.checkpoint_keeps = keeps


def checkpointed_layers(model: torch.nn.Module) -> list[int]:
    """The 0-based indices of the decoder layers `prepare_block` checkpointed."""
    return [i for i, layer in enumerate(decoder_layers(model)) if getattr(layer, "checkpoint_keeps", None)]


def apply_fsdp(model: torch.nn.Module, device: torch.device, bf16: bool,
               activation_checkpointing: BlockCheckpointing | bool, mesh_shape: tuple[int, int] | None = None,
               compile_blocks: bool = False):
    """Checkpoint and compile the decoder layers as asked (True: every layer, keeping its inputs), shard each,
    then the root, over `device_mesh(device, mesh_shape)`, and leave the model in train mode. bf16 compute with
    fp32 gradient reduction on GPU. `fully_shard` moves one layer at a time to the mesh's device (none on meta)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # from_pretrained returns eval mode, and dropout applies only in train mode.
    model.train()
    if isinstance(activation_checkpointing, bool):
        activation_checkpointing = BlockCheckpointing("full" if activation_checkpointing else "none")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    mesh = device_mesh(device, mesh_shape)
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        checkpointed = activation_checkpointing.covers(i)
        prepare_block(layer, activation_checkpointing.keeps if checkpointed else None, compile_blocks)
        # The last block's backward comes right after its forward: resharding it would gather it again at once.
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=i < len(layers) - 1)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or head.weight is not embedding.weight:
        # Its own group: the root's all-gather (first in forward) and reduce-scatter (last in backward) have
        # nothing to overlap with; a tied embedding stays in the root with the head that shares its weight.
        fully_shard(embedding, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


@dataclass(frozen=True)
class StepFlops:
    """FLOPs per token of a training step (PaLM appendix B): `base`, 6·N_non-embedding plus 6·V·d for a tied
    LM head, and `attention`, 12·L·H·Q per position the token attends to. A token of a packed example of
    length s attends to s positions, so a step's figure uses the token-weighted mean of s, not the row length."""

    base: float
    attention: float
    # What the GPUs execute beyond the model's FLOPs (`with_recompute`): the checkpointed blocks' forward again and
    # the LM head's forward again (the chunked loss recomputes each chunk's logits in backward, loss.py).
    recompute_base: float = 0.0
    recompute_attention: float = 0.0

    def per_token(self, attended_positions: float) -> float:
        """Model FLOPs per token (what MFU counts)."""
        return self.base + self.attention * attended_positions

    def hardware_per_token(self, attended_positions: float) -> float:
        """Executed FLOPs per token, recomputation included (what HFU counts)."""
        return self.per_token(attended_positions) + self.recompute_base + self.recompute_attention * attended_positions


def with_recompute(fpt: StepFlops, model: torch.nn.Module, checkpointing: "BlockCheckpointing") -> StepFlops:
    """`fpt` with what recomputation adds (call before sharding, after LoRA adapters are added): a checkpointed
    block keeping its inputs runs its forward again (2 per parameter a token goes through, 4·H·Q per attended
    position); one keeping its matmul outputs reruns no FLOPs; the chunked loss runs the LM head's forward again."""
    config = model.config
    layers = config.num_hidden_layers
    checkpointed = 0 if checkpointing.keeps == "matmuls" else sum(checkpointing.covers(i) for i in range(layers))
    decoder = sum(p.numel() for p in model.get_decoder().parameters()) - model.get_input_embeddings().weight.numel()
    decoder -= idle_expert_params(model)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    head = model.get_output_embeddings()
    head_again = 2 * head.weight.numel() if isinstance(head, torch.nn.Linear) and model.get_decoder() is not model \
        else 0
    share = checkpointed / layers
    return replace(fpt, recompute_base=float(share * 2 * decoder + head_again),
                   recompute_attention=float(checkpointed * 4 * heads * head_dim))


def step_flops(model: torch.nn.Module) -> StepFlops:
    """Call before sharding. A mixture-of-experts model counts the experts a token is routed to, not all of them."""
    config = model.config
    embedding = model.get_input_embeddings().weight.numel()
    non_embedding = sum(p.numel() for p in model.parameters()) - embedding - idle_expert_params(model)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    tied_head = 6 * embedding if getattr(config, "tie_word_embeddings", False) else 0
    return StepFlops(float(6 * non_embedding + tied_head), float(12 * config.num_hidden_layers * heads * head_dim))


def idle_expert_params(model: torch.nn.Module, frozen_only: bool = False) -> int:
    """Routed-expert parameters a token does not go through: (experts - top-k) / experts of them (of the frozen
    ones alone with `frozen_only`)."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    experts = (getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None)
               or getattr(text, "n_routed_experts", None))
    top_k = getattr(text, "num_experts_per_tok", None)
    if not experts or not top_k:
        return 0
    routed = sum(p.numel() for name, p in model.named_parameters()
                 if ".experts." in name and not (frozen_only and p.requires_grad))
    return routed * (experts - top_k) // experts


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """FLOPs per token of a step on unpacked rows of `seq_len` tokens. Call before sharding."""
    return step_flops(model).per_token(seq_len)
