"""Loading a checkpoint from run storage without running anything stored there: whoever can write the storage must
not be able to run code on the workers.

DCP pickles a checkpoint's `.metadata`, and `torch.save`s the state's non-tensor values (the optimizer's
hyperparameters) into the shards; torch's reader unpickles both without restriction. Here `.metadata` is unpickled
with nothing but the classes DCP metadata is made of, every file it points to must be named as DCP names a shard,
and the non-tensor values are read by torch's weights-only loader. Anything else is refused, before it is used.
"""

from __future__ import annotations

import io
import pickle
import re

import pyarrow.fs as pafs
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, Metadata
from torch.distributed.checkpoint.metadata import StorageMeta

from trainlift.errors import UsageError
from trainlift.train.model.dcp_reader import ArrowReader

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# (module, name) of every global a DCP `.metadata` refers to; names are matched whole, never as dotted paths.
METADATA_GLOBALS = frozenset({
    *((_DCP_METADATA, name) for name in ("Metadata", "StorageMeta", "MetadataIndex", "ChunkStorageMetadata",
                                         "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
                                         "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # how a torch.layout pickles
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id: the directory the checkpoint was written to
    ("pathlib._local", "PosixPath"),  # the same, pickled by Python 3.13 and later
    ("collections", "OrderedDict"),
    *(("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)),
})
SHARD_FILE = re.compile(r"__\d+_\d+\.distcp")


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in METADATA_GLOBALS:
            raise pickle.UnpicklingError(f"it refers to {module}.{name}")
        return super().find_class(module, name)


def refused(checkpoint: str, reason: str) -> UsageError:
    return UsageError(
        f"{checkpoint} is not a checkpoint trainlift wrote ({reason}), so it is not loaded: delete that directory "
        "to resume from the checkpoint before it, and check who else can write the run's storage")


def parse_metadata(data: bytes, checkpoint: str) -> Metadata:
    """A `.metadata` file's DCP metadata; refused unless it is made of DCP's metadata classes alone and points only
    at shard files."""
    try:
        metadata = MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 - whatever a crafted pickle raises is a refusal
        raise refused(checkpoint, f".metadata: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                      ) from None
    shaped = isinstance(metadata, Metadata) and isinstance(metadata.storage_data, dict) and isinstance(
        getattr(metadata, "storage_meta", None), (StorageMeta, type(None)))
    if not shaped:
        raise refused(checkpoint, ".metadata does not hold DCP metadata")
    files = [getattr(info, "relative_path", None) for info in metadata.storage_data.values()]
    odd = sorted({repr(name) for name in files if not (isinstance(name, str) and SHARD_FILE.fullmatch(name))})
    if odd:
        raise refused(checkpoint, f".metadata points at {', '.join(odd)}, not at shard files __<rank>_<n>.distcp")
    return metadata


class CheckpointReader(ArrowReader):
    """`ArrowReader` that reads `.metadata` through `parse_metadata`, once."""

    def __init__(self, fs: pafs.FileSystem, path: str):
        super().__init__(fs, path)
        self.parsed: dict[int | None, Metadata] = {}

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        if rank not in self.parsed:
            with self.fs.create_stream(self._get_metadata_path(rank), "rb") as stream:
                self.parsed[rank] = parse_metadata(stream.read(), self.path)
        metadata = self.parsed[rank]
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class DataOnlyPlanner(DefaultLoadPlanner):
    """DCP's load planner, with the state's non-tensor values read by torch's weights-only loader: numbers, strings,
    containers and tensors, no other objects."""

    def __init__(self, checkpoint: str):
        super().__init__()
        self.checkpoint = checkpoint

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as exc:  # noqa: BLE001
            found = re.search(r"GLOBAL ([\w.]+)", str(exc))
            raise refused(self.checkpoint, f"{fqn}: " + (f"it refers to {found[1]}" if found else
                                                         "not a plain value")) from None
        if not self.flatten_state_dict:
            self.state_dict[fqn] = loaded
            return
        *parents, last = self.mappings[fqn]
        container = self.original_state_dict
        for key in parents:
            container = container[key]
        container[last] = loaded


def load_state(state: dict, fs: pafs.FileSystem, path: str) -> None:
    """`dcp.load` of `state` from the checkpoint at `path` on `fs` (each rank reads only its parts); a refusal is
    raised as itself, not folded into DCP's report of what went wrong on every rank."""
    reader = CheckpointReader(fs, path)
    reader.read_metadata()  # DCP would take a refused `.metadata` for a missing one and look for another
    try:
        dcp.load(state, storage_reader=reader, planner=DataOnlyPlanner(path))
    except CheckpointException as exc:
        refusals = [error for error, _ in exc.failures.values() if isinstance(error, UsageError)]
        if refusals:
            raise refusals[0] from None
        raise


def check_latest_metadata(fs: pafs.FileSystem, run_path: str, step: int) -> None:
    """On the driver, before any worker starts: the `.metadata` of the checkpoint a resume will load, parsed as the
    workers parse it, so a refusal is the command's own one-line error rather than a line inside Ray's report of
    failed workers."""
    path = f"{run_path.rstrip('/')}/checkpoint_{step:08d}"
    with fs.open_input_stream(f"{path}/.metadata") as stream:
        parse_metadata(stream.read(), path)
