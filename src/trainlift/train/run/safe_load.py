"""Loading a checkpoint from run storage without running anything stored there: whoever can write the storage must
not be able to run code on the workers.

DCP pickles a checkpoint's `.metadata`, and `torch.save`s the state's non-tensor values (the optimizer's
hyperparameters) into the shards; torch's reader unpickles both without restriction. Here `.metadata` is read as
data (dcp_metadata.py: nothing it names is called or changed), every file it points to must be named as DCP names
a shard, and the non-tensor values are read by torch's weights-only loader. Anything else is refused, before it is
used.
"""

from __future__ import annotations

import io
import re

import pyarrow.fs as pafs
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, Metadata
from torch.distributed.checkpoint.metadata import StorageMeta

from trainlift.errors import UsageError
from trainlift.train.model.dcp_reader import ArrowReader
from trainlift.train.run import dcp_metadata

SHARD_FILE = re.compile(r"__\d+_\d+\.distcp")


def refused(checkpoint: str, reason: str) -> UsageError:
    return UsageError(
        f"{checkpoint} is not a checkpoint trainlift wrote ({reason}), so it is not loaded: delete that directory "
        "to resume from the checkpoint before it, and check who else can write the run's storage")


def parse_metadata(data: bytes, checkpoint: str) -> Metadata:
    """A `.metadata` file's DCP metadata; refused unless it is DCP's metadata, as plain data, and points only at
    shard files."""
    try:
        metadata = dcp_metadata.parse(data)
    except dcp_metadata.Refused as exc:
        raise refused(checkpoint, f".metadata: {exc}") from None
    if metadata.storage_data is None:
        raise refused(checkpoint, ".metadata names no shard files")
    files = [info.relative_path for info in metadata.storage_data.values()]
    odd = sorted({repr(name) for name in files if not SHARD_FILE.fullmatch(name)})
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
                self.parsed[rank] = parse_metadata(stream.read(dcp_metadata.MAX_BYTES + 1), self.path)
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
    size = fs.get_file_info(f"{path}/.metadata").size
    if size is not None and size > dcp_metadata.MAX_BYTES:  # refused without reading it
        raise refused(path, f".metadata: {size:,} bytes, over the {dcp_metadata.MAX_BYTES >> 20} MiB a .metadata "
                            "may have")
    with fs.open_input_stream(f"{path}/.metadata") as stream:
        parse_metadata(stream.read(dcp_metadata.MAX_BYTES + 1), path)
