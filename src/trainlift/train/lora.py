"""LoRA adapters (peft) on FSDP2: apply before `fully_shard`, count, validate, export, merge.

peft freezes every base weight and adds `lora_A`/`lora_B` next to each targeted
linear layer. FSDP2 shards frozen and trainable parameters in the same layer
group and reduce-scatters gradients only for the trainable ones; the optimizer
and checkpoints see only the adapters (checkpoint.py drops frozen parameters).

Exports: `adapter/` in peft's own format (`PeftModel.from_pretrained(base, dir)`)
and, unless `export.merge` is false, `final/`: the base model with every adapter
merged in, one tensor at a time (`merged_weight`), loadable without peft.
"""

from __future__ import annotations

import re

import torch

from trainlift.config.job import LoraSection
from trainlift.errors import SpecError, UsageError

ADAPTER = "default"  # peft's name for the one adapter a run trains
PEFT_PREFIX = "base_model.model."  # what peft puts before the base model's own parameter names


def _peft():
    try:
        import peft
    except ImportError:
        raise UsageError("model.lora needs the peft package",
                         hint="pip install 'trainlift[lora]' (on a cluster: trainlift submit --pip peft)") from None
    return peft


def lora_config(section: LoraSection):
    return _peft().LoraConfig(
        r=section.r, lora_alpha=section.scaling_alpha, lora_dropout=section.dropout,
        target_modules=section.target_modules, bias="none", task_type="CAUSAL_LM")


def apply(model: torch.nn.Module, section: LoraSection, seed: int = 0) -> torch.nn.Module:
    """Wrap `model` with fresh adapters, initialised from `seed` alike on every rank; the base weights are frozen.
    The global RNG is left as it was (dropout draws from it)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _peft().get_peft_model(model, lora_config(section))


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
    """FLOPs per token of a LoRA step, from full fine-tuning's: a frozen weight still costs its forward and
    input-gradient matmuls (4 per weight) but no weight gradient (the other 2); adapters cost the full 6."""
    counts = parameter_counts(model)
    embedding = model.get_input_embeddings().weight.numel()
    tied = getattr(model.config, "tie_word_embeddings", False)
    frozen_matmul = counts["total_params"] - counts["trainable_params"] - (0 if tied else embedding)
    return full_fine_tuning - 2 * frozen_matmul + 6 * counts["trainable_params"]


def save_adapter(out_dir: str, model, state_dict: dict[str, torch.Tensor], tokenizer) -> None:
    """peft's adapter format (adapter_config.json + adapter_model.safetensors) from the gathered full state dict,
    plus the tokenizer."""
    model.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


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


def merged_state_dict(state_dict: dict[str, torch.Tensor], scaling: float,
                      fan_in_fan_out: bool = False) -> dict[str, torch.Tensor]:
    """The base model's state dict with each adapter merged into its weight, under the base model's own names."""
    merged = {}
    for key, tensor in state_dict.items():
        if ".lora_" in key:
            continue
        pair = adapter_keys(key)
        if pair is not None and pair[0] in state_dict:
            tensor = merged_weight(tensor, state_dict[pair[0]], state_dict[pair[1]], scaling, fan_in_fan_out)
        merged[base_name(key)] = tensor
    return merged
