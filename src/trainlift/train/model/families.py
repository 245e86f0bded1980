"""Which models the sharded load fills correctly, decided on the driver before Ray starts (`check_loadable`).

Every causal LM of transformers loads: the files' keys are matched to the model's through transformers' own
conversion mapping (`keymap`), MoE experts fused on the way (tested against `from_pretrained` family by family in
tests/integration/test_model_families.py). Refused, in one line with the fix:
- a model type without a causal LM class in transformers: the workers could not build it;
- a pre-quantized checkpoint (`quantization_config` in config.json: fp8, GPTQ, AWQ, bitsandbytes, ...): its files
  hold quantized integers or fp8 values plus scales, which a load into trainable fp32 shards would take as weights.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path
from typing import Any

from trainlift.errors import UsageError


def check_loadable(fields: dict[str, Any]) -> None:
    """Raise a UsageError when the model of `fields` (its config.json, as written) cannot be built and filled.
    Reads no transformers module: the driver imports neither transformers nor torch."""
    model_type = fields.get("model_type")
    known = causal_lm_types()
    if known and model_type not in known:
        raise UsageError(f"model: {model_type!r} models have no causal LM class in transformers, so trainlift "
                         "cannot fine-tune them", hint="use a decoder-only causal LM (llama, qwen2, mistral, ...)")
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
