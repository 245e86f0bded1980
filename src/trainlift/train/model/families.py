"""Which models the sharded load fills correctly, decided on the driver before Ray starts (`check_loadable`).

Every causal LM of transformers loads: the files' keys are matched to the model's through transformers' own
conversion mapping (`keymap`), MoE experts fused on the way (tested against `from_pretrained` family by family in
tests/integration/test_model_families.py). Refused, in one line with the fix:
- a model type without a causal LM class in transformers: the workers could not build it;
- a model type whose loss cannot be the model's own (families.yaml `refused`, with why: packed examples that leak
  into each other, an encoder, a seq2seq decoder, ...), exactly those whose tiny model fails the comparison with
  `model(input_ids, labels=...)` in tests/integration/test_family_oracle.py;
- a pre-quantized checkpoint (`quantization_config` in config.json: fp8, GPTQ, AWQ, bitsandbytes, ...): its files
  hold quantized integers or fp8 values plus scales, which a load into trainable fp32 shards would take as weights.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from importlib import resources
from pathlib import Path
from typing import Any, Callable

import yaml

from trainlift.errors import UsageError


def check_loadable(fields: dict[str, Any]) -> None:
    """Raise a UsageError when the model of `fields` (its config.json, as written) cannot be built and filled.
    Reads no transformers module: the driver imports neither transformers nor torch."""
    model_type = fields.get("model_type")
    known = causal_lm_types()
    if known and model_type not in known:
        raise UsageError(f"model: {model_type!r} models have no causal LM class in transformers, so trainlift "
                         "cannot fine-tune them", hint="use a decoder-only causal LM (llama, qwen2, mistral, ...)")
    reason = refused().get(model_type)
    if reason is not None:
        raise UsageError(f"model: trainlift cannot fine-tune {model_type!r} models: {reason}",
                         hint="use a decoder-only causal LM (llama, qwen2, mistral, ...); docs/training.md lists "
                              "the families trainlift matches")
    method = quantization_method(fields)
    if method is not None:
        raise UsageError(f"model.path: the checkpoint is {method}-quantized (quantization_config in its config.json), "
                         "and trainlift loads only unquantized weights into its trainable shards",
                         hint="point model.path at the unquantized (bf16 or fp32) checkpoint of this model")


def quantization_method(fields: dict[str, Any]) -> str | None:
    """The `quant_method` of a pre-quantized checkpoint's config, else None."""
    quantization = fields.get("quantization_config")
    if not quantization:
        return None
    return str(quantization.get("quant_method") or "unknown") if isinstance(quantization, dict) else "unknown"


@functools.cache
def causal_lm_types() -> frozenset[str]:
    """The model types transformers has a causal LM class for (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`), read from
    its source without importing it; empty (no check) where the installed release lays it out otherwise."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    source = Path(spec.submodule_search_locations[0], "models", "auto", "modeling_auto.py")
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
        for node in tree.body:
            if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"
                                                     for t in node.targets)):
                return frozenset(key for key, _ in ast.literal_eval(node.value.args[0]))
    except (OSError, SyntaxError, ValueError, AttributeError, IndexError):
        pass
    return frozenset()


@functools.cache
def table() -> dict[str, Any]:
    """families.yaml: what trainlift must know about a family beyond its decoder (the logit post-processing and
    router loss that loss.py and objectives.py read, and the refused families)."""
    return yaml.safe_load(resources.files("trainlift.train.model").joinpath("families.yaml").read_text())


def refused() -> dict[str, str]:
    """The model types trainlift refuses, each with why."""
    return table()["refused"]


def logit_steps(model_type: str, value_of: Callable[[str], Any]) -> list[tuple[str, Any]]:
    """What the causal LM's forward does to its LM head's output, as (operation, value) steps in order, given how
    to read an attribute of its config (`value_of`)."""
    ops = {**table()["logits"], **table()["logits_by_family"].get(model_type, {})}
    return [(op, value) for name, op in ops.items() if op is not None and (value := value_of(name)) is not None]


def aux_loss_coefficient(value_of: Callable[[str], Any]) -> float:
    """The weight of the MoE router's load-balancing loss in the causal LM's loss: 0 unless the config asks the
    model to compute it (`output_router_logits`)."""
    if not value_of("output_router_logits"):
        return 0.0
    return next((float(v) for name in table()["aux_loss_coefficients"] if (v := value_of(name)) is not None), 0.0)
