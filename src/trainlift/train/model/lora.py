"""LoRA adapters (peft) on FSDP2: apply before `fully_shard`, count, validate, initialise, export, merge.

peft adds `lora_A`/`lora_B` next to each targeted linear layer of the weightless
(meta) model and freezes every base weight. FSDP2 shards frozen and trainable
parameters in the same layer group and reduce-scatters gradients only for the
trainable ones; the optimizer and checkpoints see only the adapters
(checkpoint.py drops frozen parameters). Once sharded, the base weights are read
from the HF files under their own names (`checkpoint_key`) and the adapters are
drawn here (`init_adapters`).

Exports: `adapter/` in peft's own format (`PeftModel.from_pretrained(base, dir)`)
and, unless `export.merge` is false, `final/`: the base model with every adapter
merged in, streamed one tensor at a time (`merged_weights`), loadable without peft.
"""

from __future__ import annotations

import contextlib
import math
import re
import tempfile
import warnings
from functools import partial

import pyarrow.fs as pafs
import torch
import torch.distributed as dist

from trainlift import rundir
from trainlift.config.job import LoraSection
from trainlift.errors import SpecError, UsageError
from trainlift.train.model.export import WeightSource, full_tensor
from trainlift.train.model.weights import copy_shard, cpu_seeded, tied_aliases

ADAPTER = "default"  # peft's name for the one adapter a run trains
PEFT_PREFIX = "base_model.model."  # what peft puts before the base model's own parameter names


def _peft():
    try:
        import peft
    except ImportError:
        raise UsageError("model.lora needs the peft package",
                         hint="pip install 'trainlift[lora]' (on a cluster, the job's runtime_env installs it: "
                              "render --job and submit add it)") from None
    return peft


def lora_config(section: LoraSection):
    return _peft().LoraConfig(
        r=section.r, lora_alpha=section.scaling_alpha, lora_dropout=section.dropout,
        target_modules=section.target_modules, bias="none", task_type="CAUSAL_LM")


def apply(model: torch.nn.Module, section: LoraSection) -> torch.nn.Module:
    """Wrap `model` (on the meta device, or real) with adapters and freeze the base weights. The adapters' values
    are set by `init_adapters` once the model has storage; the global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft reads transformers' deprecated `is_gradient_checkpointing`; the warning is for peft, not the user
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return _peft().get_peft_model(model, lora_config(section))


def checkpoint_key(name: str) -> str | None:
    """The HF checkpoint's name for a parameter of the adapted model; None for an adapter, which no HF file holds."""
    return None if ".lora_" in name else base_name(name)


@torch.no_grad()
def init_adapters(model: torch.nn.Module, seed: int) -> None:
    """peft's initial adapters: `lora_A` Kaiming-uniform (a=sqrt(5)), `lora_B` zero, so training starts from the
    base model itself. Each A is drawn whole, in a fixed order, on every rank from `seed`, and each rank keeps its
    shard: the same adapters at any world size. The global RNG is left as it was."""
    with cpu_seeded(seed):
        for name, param in model.named_parameters():
            if f".lora_A.{ADAPTER}." in name:
                full = torch.empty(param.shape, dtype=param.dtype)
                torch.nn.init.kaiming_uniform_(full, a=math.sqrt(5))
                copy_shard(param, full)
            elif f".lora_B.{ADAPTER}." in name:
                param.zero_()


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module):
    """The base model's forward, adapters bypassed, with every parameter's `requires_grad` left as it is. peft's
    `disable_adapter()` clears `requires_grad` on the adapters and sets it again only on the tensors the layers hold
    at the time: under FSDP2 the last block holds its unsharded copies after a forward, so its sharded adapters
    stay frozen (no gradient, no checkpoint key), and FSDP2 fixes its mixed precision on a first forward that sees
    no trainable parameter."""
    layers = [m for m in model.modules() if isinstance(m, _peft().tuners.tuners_utils.BaseTunerLayer)]
    was = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield model
    finally:
        for layer, disabled in zip(layers, was):
            layer._disable_adapters = disabled


def store_frozen_as(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Keep the frozen base weights in `dtype` (bf16 compute casts them to it at every all-gather anyway): half
    of fp32's memory for weights that never change. FSDP2 needs one dtype among trainable parameters only, so the
    adapters stay fp32 for the optimizer."""
    for param in model.parameters():
        if not param.requires_grad:
            param.data = param.data.to(dtype)


def _linear_types() -> tuple[type, ...]:
    from transformers.pytorch_utils import Conv1D

    return torch.nn.Linear, Conv1D


def linear_layer_names(model: torch.nn.Module) -> list[str]:
    """The last name component of every linear layer: the names `target_modules` can use."""
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, _linear_types())})


def check_targets(model: torch.nn.Module, section: LoraSection) -> None:
    """Target names must each match a linear layer of `model` (peft matches a name against the end of a path)."""
    if section.target_modules == "all-linear":
        return
    modules = list(model.named_modules())
    arch, known = type(model).__name__, ", ".join(linear_layer_names(model)) or "none"
    for target in section.target_modules:
        matches = [m for name, m in modules if name == target or name.endswith(f".{target}")]
        if not matches:
            raise SpecError(f"model.lora.target_modules: {target!r} matches no module of {arch} (its linear layers: "
                            f"{known})", hint="pick from those, or use all-linear")
        odd = next((m for m in matches if not isinstance(m, _linear_types())), None)
        if odd is not None:
            raise SpecError(f"model.lora.target_modules: {target!r} is a {type(odd).__name__} in {arch}, not a linear "
                            f"layer (its linear layers: {known})", hint="pick from those, or use all-linear")


def validate(config, section: LoraSection) -> None:
    """Add the adapters to a weightless (meta) copy of the model: bad targets or an architecture peft cannot adapt
    fail here, in the driver, as one line."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    check_targets(model, section)
    try:
        apply(model, section)
    except (ValueError, TypeError, NotImplementedError, KeyError) as exc:
        reason = re.sub(r"^\[[^]]*\]\s*", "", str(exc).strip().split("\n")[0]).split(". ")[0] or type(exc).__name__
        raise SpecError(f"model.lora: peft cannot add LoRA adapters to {type(model).__name__} ({reason})",
                        hint="remove model.lora to fine-tune every weight, or name other target_modules") from None


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """Trainable and total parameters (global sizes, also after sharding: a DTensor's numel is its full size)."""
    params = list(model.parameters())
    return {"trainable_params": sum(p.numel() for p in params if p.requires_grad),
            "total_params": sum(p.numel() for p in params)}


def flops_per_token(full_fine_tuning: float, model: torch.nn.Module) -> float:
    """FLOPs per token of a LoRA step, from full fine-tuning's (the parameter part: attention's own matmuls are the
    same either way): a frozen weight a token goes through still costs its forward and input-gradient matmuls (4
    per weight) but no weight gradient (the other 2); adapters cost the full 6. The experts a token is not routed
    to cost nothing, here as in full fine-tuning's count (`build.step_flops`)."""
    from trainlift.train.model.build import idle_expert_params

    counts = parameter_counts(model)
    embedding = model.get_input_embeddings().weight.numel()
    tied = getattr(model.config, "tie_word_embeddings", False)
    frozen_matmul = (counts["total_params"] - counts["trainable_params"] - (0 if tied else embedding)
                     - idle_expert_params(model, frozen_only=True))
    return full_fine_tuning - 2 * frozen_matmul + 6 * counts["trainable_params"]


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """The adapters' whole tensors on rank 0's CPU (None elsewhere), under peft's parameter names: one gather to
    rank 0 per adapter tensor (every rank calls it), and nothing of the base model."""
    return {name: full_tensor(t) for name, t in model.state_dict().items() if ".lora_" in name}


def save_adapter(fs: pafs.FileSystem, out_dir: str, model, tokenizer, base_model: str | None = None) -> None:
    """`out_dir` in peft's adapter format (adapter_config.json + adapter_model.safetensors, as
    `PeftModel.save_pretrained` writes them) plus the tokenizer, written by rank 0. A collective. `base_model`:
    what adapter_config.json names as its base (the hub id or URI the job gave, not a node-local copy)."""
    state = adapter_state(model)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    if base_model is not None:
        model.peft_config[ADAPTER].base_model_name_or_path = base_model
    with tempfile.TemporaryDirectory(prefix="trainlift-adapter-") as tmp:
        model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        rundir.copy_into(tmp, fs, out_dir)  # on a local disk through no link


def scaling_of(model) -> tuple[float, bool]:
    """(alpha / r, fan_in_fan_out) of the run's adapter: what `merged_weight` needs."""
    config = model.peft_config[ADAPTER]
    if config.use_rslora or config.use_dora or config.rank_pattern or config.alpha_pattern:
        raise ValueError("merging supports plain LoRA only (no rsLoRA, DoRA or per-layer ranks)")
    return config.lora_alpha / config.r, config.fan_in_fan_out


def base_name(key: str) -> str:
    """The base model's name for a peft parameter name ('...q_proj.base_layer.weight' -> '...q_proj.weight')."""
    return key.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def adapter_keys(key: str) -> tuple[str, str] | None:
    """The lora_A/lora_B names that belong to a peft base weight name, or None for a weight without an adapter."""
    if not key.endswith(".base_layer.weight"):
        return None
    layer = key.removesuffix("base_layer.weight")
    return f"{layer}lora_A.{ADAPTER}.weight", f"{layer}lora_B.{ADAPTER}.weight"


def merged_weight(base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float,
                  fan_in_fan_out: bool = False) -> torch.Tensor:
    """W + scaling * B @ A (transposed for Conv1D-style layers), computed in fp32, returned in W's dtype."""
    delta = (lora_b.float() @ lora_a.float()) * scaling
    return (base.float() + (delta.T if fan_in_fan_out else delta)).to(base.dtype)


def merged_weights(model: torch.nn.Module) -> dict[str, WeightSource]:
    """The export sources of the merged model: under the base model's names, each adapted weight as W + alpha/r *
    B @ A (W, A and B gathered one at a time), every other weight as it is; no adapter tensor is written."""
    scaling, fan_in_fan_out = scaling_of(model)
    aliases = tied_aliases(model)
    state = model.state_dict()
    sources = {}
    for key, tensor in state.items():
        if key in aliases or ".lora_" in key:
            continue
        pair = adapter_keys(key)
        if pair is not None and pair[0] in state:
            full = partial(_merged_full, tensor, state[pair[0]], state[pair[1]], scaling, fan_in_fan_out)
        else:
            full = partial(full_tensor, tensor)
        sources[base_name(key)] = WeightSource(tuple(tensor.shape), tensor.dtype, full)
    return sources


def _merged_full(base, lora_a, lora_b, scaling: float, fan_in_fan_out: bool) -> torch.Tensor | None:
    """On rank 0 the merged weight; None on the other ranks, which only send their shards."""
    parts = full_tensor(base), full_tensor(lora_a), full_tensor(lora_b)
    return None if parts[0] is None else merged_weight(*parts, scaling, fan_in_fan_out)
