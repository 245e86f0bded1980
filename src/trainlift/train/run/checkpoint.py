"""Sharded DCP checkpoints with an atomic commit, resumption and pruning (the HF export is in export.py).

Layout under the run directory (local path or s3://, through a pyarrow filesystem):

  checkpoint_00000010/
    .metadata, __<rank>_0.distcp   model + optimizer (DCP; reshards on load)
    trainer_state.json             step, data cursor, LR scheduler (rank 0)
    config.json                    the model's transformers config (rank 0): a full fine-tune resumes
                                   from the checkpoint alone, without model.path
    rng_rank<r>.pt                 each rank's RNG state
    COMPLETE                       written last, once every rank has finished

A directory without COMPLETE is never resumed from, and is removed once a
newer checkpoint is complete. COMPLETE is only written after the files every
rank uploaded are listed in storage: an upload can lose files without an error
(pyarrow's copy_files to S3 drops a failed part upload on the floor).

The bookkeeping (listing, marking, pruning, the saved model config) imports no torch: the driver uses it.
"""

from __future__ import annotations

import io
import json
import re
import time
from pathlib import Path

import pyarrow.fs as pafs

from trainlift import rundir

MARKER = "COMPLETE"
TRAINER_STATE = "trainer_state.json"
MODEL_CONFIG = "config.json"
_NAME = re.compile(r"^checkpoint_(\d{8})$")


def dir_name(step: int) -> str:
    return f"checkpoint_{step:08d}"


def step_of(path: str) -> int | None:
    match = _NAME.match(path.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def is_complete(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(f"{path}/{MARKER}").type == pafs.FileType.File


def list_checkpoints(fs: pafs.FileSystem, run_path: str) -> list[tuple[int, str, bool]]:
    """(step, path, complete) for every checkpoint directory, oldest first."""
    infos = fs.get_file_info(pafs.FileSelector(run_path, allow_not_found=True))
    found = []
    for info in infos:
        step = step_of(info.path)
        if info.type == pafs.FileType.Directory and step is not None:
            found.append((step, info.path, is_complete(fs, info.path)))
    return sorted(found)


def latest_complete(fs: pafs.FileSystem, run_path: str) -> tuple[int, str] | None:
    complete = [(step, path) for step, path, done in list_checkpoints(fs, run_path) if done]
    return complete[-1] if complete else None


class IncompleteCheckpointError(OSError):
    """A checkpoint's upload finished without all of its files in storage."""


def missing_files(fs: pafs.FileSystem, path: str, world_size: int) -> list[str]:
    """Files a checkpoint saved by `world_size` ranks needs that are not in `path` (`__<r>_*.distcp` per rank)."""
    infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    present = {info.base_name for info in infos if info.type == pafs.FileType.File}
    missing = [name for name in (".metadata", TRAINER_STATE) if name not in present]
    for rank in range(world_size):
        if not any(name.startswith(f"__{rank}_") and name.endswith(".distcp") for name in present):
            missing.append(f"__{rank}_0.distcp")
        if f"rng_rank{rank}.pt" not in present:
            missing.append(f"rng_rank{rank}.pt")
    return missing


def mark_complete(fs: pafs.FileSystem, path: str, step: int, world_size: int) -> None:
    """Write COMPLETE, after checking that every rank's files reached storage."""
    missing = missing_files(fs, path, world_size)
    if missing:
        raise IncompleteCheckpointError(
            f"{path.rstrip('/').rsplit('/', 1)[-1]} was not fully uploaded (missing {', '.join(missing)}), "
            f"so it is not marked {MARKER}")
    if isinstance(fs, pafs.LocalFileSystem):  # a link planted in it while it was written: not marked complete
        rundir.refuse_link_dir(path)
    rundir.write_file(fs, f"{path}/{MARKER}", json.dumps({"step": step, "world_size": world_size,
                                                           "time": time.time()}).encode())


def prune(fs: pafs.FileSystem, run_path: str, keep: int) -> list[str]:
    """Delete complete checkpoints beyond the newest `keep`, and unfinished ones older than the newest."""
    entries = list_checkpoints(fs, run_path)
    complete = [path for _, path, done in entries if done]
    if not complete:
        return []
    newest_step = step_of(complete[-1])
    doomed = complete[:-keep] + [path for step, path, done in entries if not done and step < newest_step]
    for path in doomed:
        rundir.delete_dir(fs, path)
    return doomed


def remove_unfinished_after(fs: pafs.FileSystem, run_path: str, step: int) -> None:
    """Leftovers of a crashed save beyond the resume point would be merged into by the next save."""
    for s, path, done in list_checkpoints(fs, run_path):
        if s > step and not done:
            rundir.delete_dir(fs, path)


def trainable_state(model, optimizer) -> tuple[dict, dict]:
    """Model and optimizer state without frozen weights (LoRA: the base model comes from model.path, not from
    checkpoints). A frozen weight tied under a second name (a tied LM head) escapes `ignore_frozen_params`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in model_sd.items() if k not in frozen}, optim_sd


def write_shard(local_dir: str, model, optimizer, scheduler, step: int, cursor: int, rank: int, world: int) -> None:
    """This rank's part of a checkpoint, written to a local directory that is then uploaded."""
    import torch.distributed.checkpoint as dcp

    model_sd, optim_sd = trainable_state(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=local_dir)
    write_extras(local_dir, model, scheduler, step, cursor, rank, world)


def write_extras(local_dir: str, model, scheduler, step: int, cursor: int, rank: int, world: int) -> None:
    """Everything of this rank's part but the DCP shards: its RNG state and, on rank 0, the trainer state and the
    model config."""
    import torch

    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, Path(local_dir) / f"rng_rank{rank}.pt")
    if rank == 0:
        state = {"step": step, "cursor": cursor, "world_size": world, "scheduler": scheduler.state_dict()}
        (Path(local_dir) / TRAINER_STATE).write_text(json.dumps(state))
        if getattr(model, "config", None) is not None:
            (Path(local_dir) / MODEL_CONFIG).write_text(model.config.to_json_string(use_diff=False))


def load(fs: pafs.FileSystem, path: str, model, optimizer, scheduler, rank: int) -> tuple[int, int]:
    """Load a checkpoint (saved by any number of ranks) into this rank, reading only the parts this rank needs
    straight from `fs` (local or S3); returns (step, data cursor)."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    from trainlift.train.run.safe_load import load_state

    model_sd, optim_sd = trainable_state(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    load_state(state, fs, path)  # fails on any trainable key the checkpoint lacks
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=False))  # frozen weights are absent on purpose
    trainer = json.loads(_read(fs, f"{path}/{TRAINER_STATE}"))
    scheduler.load_state_dict(trainer["scheduler"])
    rng_file = f"{path}/rng_rank{rank}.pt"
    if fs.get_file_info(rng_file).type == pafs.FileType.File:
        rng = torch.load(io.BytesIO(_read(fs, rng_file)), weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return trainer["step"], trainer["cursor"]


def model_config_fields(fs: pafs.FileSystem, path: str) -> dict | None:
    """The model config saved with the checkpoint at `path`, as written; None for a checkpoint saved without one."""
    file = f"{path}/{MODEL_CONFIG}"
    if fs.get_file_info(file).type != pafs.FileType.File:
        return None
    return json.loads(_read(fs, file))


def model_config(fs: pafs.FileSystem, path: str):
    """The model's transformers config saved with the checkpoint at `path`, or None."""
    fields = model_config_fields(fs, path)
    if fields is None:
        return None
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[fields["model_type"]].from_dict(fields)


def _read(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_stream(path) as stream:
        return stream.readall()


def load_weights_unsharded(checkpoint_dir: str, model) -> None:
    """Load a checkpoint's model weights into a plain (unsharded, single-process) model."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from trainlift.train.run.safe_load import load_state

    model_sd = get_model_state_dict(model)
    state = {"model": model_sd}
    load_state(state, pafs.LocalFileSystem(), checkpoint_dir)
    model.load_state_dict(state["model"])
