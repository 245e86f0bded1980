"""The declared torch floor is the oldest release that has every torch API the code imports.

PUBLIC_SINCE lists each import (and keyword) with the release that has it, and why. A new torch import fails
the first test until it is listed here; the floor in pyproject.toml must be the newest of these releases."""

from __future__ import annotations

import ast
import runpy
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ROOT / "src" / "trainlift"
GPU_TEST_MACHINE_TORCH = Version("2.11")

FSDP2 = "FSDP2 public in torch.distributed.fsdp since 2.6 (torch.distributed._composable.fsdp before)"
DCP_STATE_DICT = "torch.distributed.checkpoint.state_dict (get/set_state_dict, StateDictOptions) present by 2.3"
CORE = "present by 2.0"
PUBLIC_SINCE = {
    "torch": ("2.0", CORE),
    "torch.distributed": ("2.0", CORE),
    "torch.distributed.checkpoint": ("2.0", CORE),
    "torch.nn.functional": ("2.0", CORE),
    "torch.func.functional_call": ("2.0", "torch.func public since 2.0"),
    "torch.multiprocessing": ("2.0", CORE),
    "torch.utils.checkpoint.checkpoint": ("2.0", CORE),
    "torch.utils.checkpoint.CheckpointPolicy": ("2.4", "selective activation checkpointing, public since 2.4"),
    "torch.utils.checkpoint.create_selective_checkpoint_contexts": (
        "2.4", "selective activation checkpointing, public since 2.4"),
    "torch.utils.tensorboard.SummaryWriter": ("2.0", CORE),
    "torch.distributed.checkpoint.FileSystemReader": ("2.0", CORE),
    "torch.distributed.checkpoint.DefaultLoadPlanner": ("2.0", CORE),
    "torch.distributed.checkpoint.Metadata": ("2.0", CORE),
    "torch.distributed.checkpoint.CheckpointException": ("2.0", CORE),
    "torch.distributed.checkpoint.metadata.StorageMeta": ("2.4", "Metadata.storage_meta since 2.4 (#124772)"),
    **{f"torch.distributed.checkpoint.{name}": ("2.0", "DCP's metadata classes (.metadata pickles them), by 2.0")
       for name in ("metadata.BytesStorageMetadata", "metadata.ChunkStorageMetadata", "metadata.MetadataIndex",
                    "metadata.TensorProperties", "metadata.TensorStorageMetadata", "filesystem._StorageInfo")},
    "torch.distributed.checkpoint.filesystem.FileSystemBase": ("2.3", "base of the fsspec reader, present by 2.3"),
    "torch.distributed.checkpoint.state_dict.StateDictOptions": ("2.3", DCP_STATE_DICT),
    "torch.distributed.checkpoint.state_dict.get_model_state_dict": ("2.3", DCP_STATE_DICT),
    "torch.distributed.checkpoint.state_dict.get_state_dict": ("2.3", DCP_STATE_DICT),
    "torch.distributed.checkpoint.state_dict.set_state_dict": ("2.3", DCP_STATE_DICT),
    "torch.distributed.device_mesh.init_device_mesh": ("2.2", "torch.distributed.device_mesh public since 2.2"),
    "torch.distributed.tensor.DTensor": ("2.5", "torch.distributed.tensor public since 2.5 (._tensor before)"),
    "torch.distributed.tensor.distribute_tensor": ("2.5", "torch.distributed.tensor public since 2.5"),
    "distribute_tensor(src_data_rank=)": ("2.7", "keyword added by pytorch/pytorch#143883, first in 2.7"),
    "torch.distributed.fsdp.fully_shard": ("2.6", FSDP2),
    "torch.distributed.fsdp.FSDPModule": ("2.6", FSDP2),
    "torch.distributed.fsdp.MixedPrecisionPolicy": ("2.6", FSDP2),
    "torch.distributed.checkpoint.state_dict_saver.AsyncCheckpointerType": (
        "2.7", "async_save's async_checkpointer_type (THREAD/PROCESS) since 2.7 (FACTS.md)"),
    "torch.distributed.checkpoint.staging.DefaultStager": (
        "2.9", "async_save(async_stager=...) with DefaultStager and StagingOptions since 2.9 (pytorch/pytorch#156207)"),
    "torch.distributed.checkpoint.staging.StagingOptions": (
        "2.9", "async_save(async_stager=...) with DefaultStager and StagingOptions since 2.9 (pytorch/pytorch#156207)"),
    "torch.distributed.checkpoint.HuggingFaceStorageReader": (
        "2.8", "exported from torch.distributed.checkpoint since 2.8 (private _hf_storage in 2.7)"),
}


def torch_apis_used() -> set[str]:
    """`import torch.x` modules, `from torch.x import y` names, and keywords listed above, over src/trainlift."""
    used = set()
    for path in SOURCES.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                used |= {alias.name for alias in node.names if alias.name.split(".")[0] == "torch"}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
                used |= {f"{node.module}.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "distribute_tensor":
                if any(keyword.arg == "src_data_rank" for keyword in node.keywords):
                    used.add("distribute_tensor(src_data_rank=)")
    return used


def declared_floor() -> Version:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch = next(Requirement(dep) for dep in deps if Requirement(dep).name == "torch")
    floors = [Version(spec.version) for spec in torch.specifier if spec.operator == ">="]
    assert len(floors) == 1, torch
    return floors[0]


def test_every_torch_api_the_code_imports_is_listed():
    unlisted = torch_apis_used() - set(PUBLIC_SINCE)
    assert not unlisted, f"add these to PUBLIC_SINCE with the first release that has them: {sorted(unlisted)}"


def test_the_declared_floor_is_the_newest_release_any_used_api_needs():
    used = torch_apis_used()
    needed = max(Version(PUBLIC_SINCE[api][0]) for api in used)
    assert declared_floor() == needed
    assert needed <= GPU_TEST_MACHINE_TORCH


def test_the_readme_states_the_declared_floor():
    docs_text = runpy.run_path(str(ROOT / "tests" / "docs_text.py"))["docs_text"]  # README.md and docs/*.md
    assert f"torch ≥ {declared_floor()}" in docs_text()
