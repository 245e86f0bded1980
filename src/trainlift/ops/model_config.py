"""Read a job's model config without its weights: model.config, a local directory, or the Hugging Face hub
(its local cache first)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from trainlift.errors import SpecError
from trainlift.hub_fetch import hub_offline_reason

OFFLINE_HINT = ("offline, give estimate the model's config.json: --model-config PATH (the repository's "
                "examples/model-configs/ has the examples' models)")


def _from_dict(config: dict[str, Any], tokenizer: str | None):
    from transformers import AutoConfig, AutoTokenizer

    config = dict(config)
    model_type = config.pop("model_type", None)
    if not model_type:
        raise SpecError("model.config: no model_type", hint="e.g. model_type: qwen2")
    if "vocab_size" not in config and tokenizer:
        config["vocab_size"] = len(AutoTokenizer.from_pretrained(tokenizer))
    try:
        return AutoConfig.for_model(model_type, **config)
    except (ValueError, KeyError) as exc:
        raise SpecError(f"model.config: {str(exc).splitlines()[0]}",
                        hint="model_type must be a transformers architecture, e.g. llama, qwen2") from None


def read_config_file(path: str | Path, tokenizer: str | None = None):
    """A config.json file's transformers config."""
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SpecError(f"cannot read the model config {path}: {exc}",
                        hint="give a config.json path or the config as a mapping") from None
    return _from_dict(config, tokenizer)


def read_model_config(model_spec):
    """The transformers config of `model_spec` (a job spec's `model` section)."""
    from transformers import AutoConfig

    if model_spec.config is not None:
        tokenizer = model_spec.tokenizer or model_spec.path
        if isinstance(model_spec.config, str):
            return read_config_file(model_spec.config, tokenizer)
        return _from_dict(model_spec.config, tokenizer)
    path = model_spec.path
    if "://" in path:
        raise SpecError(f"model.path {path}: estimate reads a local directory or a hub id",
                        hint="pass model.config (the model's config.json) with --set or in the spec")
    try:
        if Path(path).expanduser().is_dir():
            return AutoConfig.from_pretrained(str(Path(path).expanduser()))
        try:
            return AutoConfig.from_pretrained(path, local_files_only=True)
        except OSError:
            if (offline := hub_offline_reason()) is not None:
                raise SpecError(f"model.path {path}: its config.json is not in the hub cache and the hub cannot be "
                                f"asked ({offline})", hint=OFFLINE_HINT) from None
            print(f"{path}: config.json is not in the hub cache; asking the hub", file=sys.stderr)
            return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise SpecError(f"model.path {path}: cannot read its config.json ({str(exc).splitlines()[0]})",
                        hint=f"{OFFLINE_HINT}; else check the path or hub id, or download it first "
                        f"(huggingface-cli download {path} config.json)") from None
