"""Which safetensors keys fill which model parameters, decided by transformers' own checkpoint conversion mapping
(`conversion_mapping.get_model_conversion_mapping`, applied key by key with `core_model_loading.rename_source_key`,
as `from_pretrained` does): no table of names is kept here.

transformers 5 renames some keys on load (GPT-NeoX's `embed_out` -> `lm_head`, Mixtral's `block_sparse_moe` -> `mlp`)
and fuses others (the per-expert `experts.{i}.w1/w3` or `gate_proj/up_proj` matrices of Mixtral and Qwen3-MoE into one
3-D `experts.gate_up_proj`), and `save_pretrained` writes the files' layout back. A key that is only renamed is read
as before, each rank reading the slices of its shards (`KeyPlan.renamed`, for `dcp.load`). A fused parameter is built
by the mapping's own `WeightConverter` from its source tensors, one fused parameter at a time
(`KeyPlan.converted_tensors`); the caller keeps its shard of it.
"""

from __future__ import annotations

from collections import defaultdict
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key


@dataclass
class ConvertedGroup:
    """The source keys, by the converter's source pattern, of the parameters one `WeightConverter` builds."""

    converter: WeightConverter
    sources: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))


@dataclass
class KeyPlan:
    """`renamed`: model key -> the file key holding it as is. `groups`: first target key -> its converter group;
    `targets`: every model key a converter builds -> the first target key of its group."""

    reference: torch.nn.Module
    files: dict[str, Path]
    renamed: dict[str, str] = field(default_factory=dict)
    groups: dict[str, ConvertedGroup] = field(default_factory=dict)
    targets: dict[str, str] = field(default_factory=dict)

    def covers(self, key: str) -> bool:
        return key in self.renamed or key in self.targets

    def converted_tensors(self, wanted: Iterable[str]) -> Iterator[dict[str, torch.Tensor]]:
        """For each converter group that builds a key in `wanted`: its full target tensors, built from the files by
        transformers' converter. Only one group's tensors are alive at a time (the caller drops them)."""
        wanted = set(wanted)
        for first in sorted({self.targets[key] for key in wanted if key in self.targets}, key=dot_natural_key):
            yield self._convert(first)

    def _convert(self, first: str) -> dict[str, torch.Tensor]:
        group = self.groups[first]
        converter = deepcopy(group.converter)
        tensors = read_tensors(self.files, [key for keys in group.sources.values() for key in keys])
        for pattern, keys in group.sources.items():
            for key in keys:
                converter.add_tensor(first, key, pattern, tensors.pop(key))
        built = converter.convert(first, model=self.reference, config=self.reference.config)
        return {name: tensor[0] if isinstance(tensor, list) else tensor for name, tensor in built.items()}


def file_index(model_dir: Path) -> dict[str, Path]:
    """Every tensor key of the safetensors files in `model_dir` -> the file holding it (headers only)."""
    index = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            index.update(dict.fromkeys(handle.keys(), path))
    return index


def read_tensors(files: dict[str, Path], keys: list[str]) -> dict[str, torch.Tensor]:
    """The full tensors of `keys`, opening each file they lie in once."""
    by_file = defaultdict(list)
    for key in keys:
        by_file[files[key]].append(key)
    tensors = {}
    for path, in_file in by_file.items():
        with safe_open(str(path), framework="pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in in_file})
    return tensors


def reference_model(config: PretrainedConfig) -> torch.nn.Module:
    """The unwrapped model class on the meta device: transformers looks its mapping up by class name and model_type
    (a model wrapped by FSDP or peft has neither under its own name)."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def plan(config: PretrainedConfig, files: dict[str, Path]) -> KeyPlan:
    """Map every file key to the model key it fills, as `from_pretrained` would (renamings first, then at most one
    converter; the base model prefix added or dropped where the model needs it). File keys that fill nothing are
    left out; keys are visited in transformers' order, so a converter stacks experts 0, 1, ... 10 in that order."""
    reference = reference_model(config)
    mapping = get_model_conversion_mapping(reference)
    renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    model_keys = reference.state_dict()
    result = KeyPlan(reference, files)
    for key in sorted(files, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, reference.base_model_prefix, model_keys)
        if target not in model_keys and key in model_keys:
            target, pattern = key, None
        if target not in model_keys:
            continue
        if pattern is None:
            result.renamed.setdefault(target, key)
            continue
        converter = by_pattern[pattern]
        group = result.groups.setdefault(target, ConvertedGroup(converter))
        group.sources[pattern].append(key)
        for produced in converter.target_patterns:
            result.targets[target.replace(converter.target_patterns[0], produced)] = target
    return result
