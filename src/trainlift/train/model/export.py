"""The HF export of a sharded model, written without gathering it.

`<run>/final/` is a `from_pretrained`-loadable directory: `model.safetensors` (or
`model-0000N-of-0000M.safetensors` plus `model.safetensors.index.json` when larger than one
file), config.json, generation_config.json and the tokenizer.

The weights are streamed tensor by tensor: every rank of rank 0's shard group sends its shard of a tensor
to rank 0 (a gather, not an all-gather), and rank 0 appends the tensor to the open safetensors file through
the run's pyarrow filesystem (local or s3://). Rank 0 holds at most one full tensor beyond its training state;
no other rank ever holds a full tensor, on the device or the host. Every tensor's shape is known
before anything is gathered, which lets the safetensors header be written first. What is written is a dict of
`WeightSource`s: the model's own state dict, or tensors computed from it one at a time (LoRA merged into its
base weights, `lora.merged_weights`).
DCP's `HuggingFaceStorageWriter` with consolidation was not used: it needs every rank's files on
one filesystem (it cannot write to s3://, nor across nodes without a shared volume).
"""

from __future__ import annotations

import json
import struct
import tempfile
from functools import partial
from pathlib import Path
from typing import Callable, NamedTuple

import pyarrow.fs as pafs
import torch
import torch.distributed as dist

from trainlift import rundir

from trainlift.train.model.weights import tied_aliases

MAX_FILE_BYTES = 5 * 1024**3
INDEX = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


def export_dtype(stored: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    return dtype if stored.is_floating_point else stored


def plan_files(entries: list[tuple[str, tuple[int, ...], torch.dtype]], max_file_bytes: int = MAX_FILE_BYTES
               ) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
    """Split (name, shape, dtype) entries, in order, into files of at most `max_file_bytes` (one tensor may
    exceed it alone)."""
    files: list[list] = [[]]
    size = 0
    for name, shape, dtype in entries:
        nbytes = nbytes_of(shape, dtype)
        if files[-1] and size + nbytes > max_file_bytes:
            files.append([])
            size = 0
        files[-1].append((name, shape, dtype))
        size += nbytes
    return files


def nbytes_of(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def file_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def safetensors_header(entries: list[tuple[str, tuple[int, ...], torch.dtype]]) -> bytes:
    """The 8-byte length and JSON header of a safetensors file whose tensors follow in `entries` order."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in entries:
        end = offset + nbytes_of(shape, dtype)
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def full_tensor(tensor: torch.Tensor) -> torch.Tensor | None:
    """The whole tensor on rank 0's CPU; None on every other rank, which never holds it whole. A DTensor's shards
    are gathered to rank 0 from its shard group (every rank must call it; ranks of other HSDP replicas only
    return)."""
    from torch.distributed.tensor import DTensor

    rank = dist.get_rank() if dist.is_initialized() else 0
    if not isinstance(tensor, DTensor):
        return tensor.detach().cpu() if rank == 0 else None
    sharded = [i for i, placement in enumerate(tensor.placements) if placement.is_shard()]
    if not sharded:
        return tensor.to_local().detach().cpu() if rank == 0 else None
    (mesh_dim,) = sharded
    group = tensor.device_mesh.get_group(mesh_dim)
    if dist.get_global_rank(group, 0) != 0:
        return None
    return gathered_to_rank0(tensor.to_local().detach(), tensor.placements[mesh_dim].dim, tensor.shape, group)


def gathered_to_rank0(local: torch.Tensor, dim: int, shape: torch.Size, group) -> torch.Tensor | None:
    """`local` shards (torch.chunk's split along `dim`, as FSDP2 makes them: equal chunks, the last ones short or
    empty) padded to one chunk, gathered to the group's first rank and joined there, on the CPU."""
    ranks = dist.get_world_size(group)
    chunk = -(-shape[dim] // ranks)
    padded_shape = list(shape)
    padded_shape[dim] = chunk
    padded = local
    if local.shape[dim] != chunk or not local.is_contiguous():  # a short (or empty) last shard
        padded = local.new_zeros(padded_shape)
        padded.narrow(dim, 0, local.shape[dim]).copy_(local)
    first = dist.get_rank(group) == 0
    whole = None
    if first:  # along dim 0 the shards land in place in one buffer; along another dim they are joined after
        padded_shape[dim] = chunk * ranks
        whole = local.new_empty(padded_shape)
        parts = list(whole.chunk(ranks, dim)) if dim == 0 else [torch.empty_like(padded) for _ in range(ranks)]
    dist.gather(padded, parts if first else None, dst=dist.get_global_rank(group, 0), group=group)
    if not first:
        return None
    joined = whole if dim == 0 else torch.cat(parts, dim)
    return joined.narrow(dim, 0, shape[dim]).cpu()


class WeightSource(NamedTuple):
    """One exported tensor: its shape and stored dtype up front, and `full()`, which returns the whole tensor
    on rank 0's CPU and None elsewhere (a collective when it is gathered from shards: every rank calls it, in the
    same order)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    full: Callable[[], torch.Tensor]


def model_weights(model: torch.nn.Module) -> dict[str, WeightSource]:
    """The model's own state dict as export sources; tied parameters once, as transformers writes them."""
    aliases = tied_aliases(model)
    return {name: WeightSource(tuple(t.shape), t.dtype, partial(full_tensor, t))
            for name, t in model.state_dict().items() if name not in aliases}


def write_weights(fs: pafs.FileSystem, out_dir: str, weights: dict[str, WeightSource], dtype: torch.dtype,
                  max_file_bytes: int = MAX_FILE_BYTES) -> list[str]:
    """Stream `weights` (floating ones cast to `dtype`) into safetensors files under `out_dir` on rank 0.
    Every rank calls it."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    entries = [(name, source.shape, export_dtype(source.dtype, dtype)) for name, source in weights.items()]
    files = plan_files(entries, max_file_bytes)
    names = file_names(len(files))
    if rank == 0:
        rundir.make_dir(fs, out_dir)
    for file_name, file_entries in zip(names, files):
        out = rundir.open_output(fs, f"{out_dir}/{file_name}") if rank == 0 else None
        if out is not None:
            out.write(safetensors_header(file_entries))
        for name, _, entry_dtype in file_entries:
            tensor = weights[name].full()
            if out is not None:
                out.write(tensor.to(entry_dtype).contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del tensor
        if out is not None:
            out.close()
    if rank == 0 and len(files) > 1:
        weight_map = {name: file_name for file_name, file_entries in zip(names, files) for name, _, _ in file_entries}
        index = {"metadata": {"total_size": sum(nbytes_of(s, d) for _, s, d in entries)}, "weight_map": weight_map}
        with rundir.open_output(fs, f"{out_dir}/{INDEX}") as out:
            out.write(json.dumps(index, indent=2).encode())
    return names


def write_metadata(fs: pafs.FileSystem, out_dir: str, config, tokenizer, dtype: torch.dtype,
                   source_dir: str | None) -> None:
    """config.json (with the export dtype), generation_config.json (the source model's when it has one) and
    the tokenizer files."""
    from transformers import GenerationConfig

    config = config.__class__.from_dict(config.to_dict())
    config.dtype = dtype
    with tempfile.TemporaryDirectory(prefix="trainlift-export-") as tmp:
        config.save_pretrained(tmp)
        source = Path(source_dir) / "generation_config.json" if source_dir else None
        if source is not None and source.is_file():
            (Path(tmp) / source.name).write_bytes(source.read_bytes())
        else:
            GenerationConfig.from_model_config(config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        rundir.copy_into(tmp, fs, out_dir)


def export_hf(fs: pafs.FileSystem, out_dir: str, model: torch.nn.Module, config, tokenizer, dtype: torch.dtype,
              source_dir: str | None = None, max_file_bytes: int = MAX_FILE_BYTES,
              weights: dict[str, WeightSource] | None = None) -> None:
    """Write the `from_pretrained`-loadable export of a (sharded) model, or of `weights` computed from it
    (LoRA merged into the base). A collective: every rank calls it."""
    write_weights(fs, out_dir, model_weights(model) if weights is None else weights, dtype, max_file_bytes)
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_metadata(fs, out_dir, config, tokenizer, dtype, source_dir)
