"""Per-step metrics: a JSONL sink under the run's storage, throughput and MFU."""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import tempfile

from typing import TYPE_CHECKING

import pyarrow.fs as pafs

from trainlift.rundir import open_local

if TYPE_CHECKING:
    import torch


def finite_or_null(value):
    """`value` with every float that is not a finite number (a diverged loss, no step timed) as None: what
    trainlift writes is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(item) for item in value]
    return value


class LocalMirror:
    """A local path standing for `remote` on `fs`: `remote` itself on a local filesystem; on object storage a
    temporary copy (of a file named `name`, seeded from the remote one when it exists; else of a directory) that
    `upload()` copies back."""

    def __init__(self, fs: pafs.FileSystem, remote: str, name: str | None = None):
        self.fs, self.remote = fs, remote
        self.is_local = isinstance(fs, pafs.LocalFileSystem)
        if self.is_local:
            self.path = remote
            return
        self.directory = tempfile.mkdtemp(prefix="trainlift-mirror-")
        self.path = os.path.join(self.directory, name) if name else self.directory
        if name and fs.get_file_info(remote).type == pafs.FileType.File:
            pafs.copy_files(remote, self.path, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())

    def upload(self) -> None:
        if not self.is_local:
            pafs.copy_files(self.path, self.remote, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=self.fs)

    def remove(self) -> None:
        """Drop the temporary copy (after its last upload)."""
        if not self.is_local:
            shutil.rmtree(self.directory, ignore_errors=True)


class JsonlSink:
    """Appends one JSON object per line to <run>/metrics.jsonl.

    On object storage it appends to a local mirror of the file (so a resumed run appends) and uploads it on
    `flush()`, which the recipe calls at checkpoint and evaluation boundaries and at the end.
    """

    def __init__(self, fs: pafs.FileSystem, path: str):
        self.mirror = LocalMirror(fs, path, "metrics.jsonl")
        self._fh = io.TextIOWrapper(open_local(self.mirror.path, append=True), encoding="utf-8")  # not via a link

    def write(self, row: dict) -> None:
        self._fh.write(json.dumps(finite_or_null(row), allow_nan=False) + "\n")
        self._fh.flush()

    def flush(self) -> None:
        self.mirror.upload()

    def checkpointed(self, step: int) -> None:
        pass

    def close(self, summary: dict | None = None) -> None:
        self.flush()
        self._fh.close()
        self.mirror.remove()

    def recorded_initial_eval(self) -> float | None:
        """The eval loss the run measured at step 0, as an earlier start of it wrote it (None if it never did)."""
        initial = None
        with open(self.mirror.path, encoding="utf-8") as rows:
            for line in rows:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(row, dict) and row.get("step") == 0 and "eval_loss" in row:
                    initial = row["eval_loss"]
        return initial


class NullSink:
    """What ranks other than 0 write to."""

    def write(self, row: dict) -> None:
        pass

    def flush(self) -> None:
        pass

    def checkpointed(self, step: int) -> None:
        pass

    def close(self, summary: dict | None = None) -> None:
        pass

    def recorded_initial_eval(self) -> float | None:
        return None


def device_peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of this GPU from the hardware catalog; None on CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    import torch

    from trainlift.catalog import peak_flops_for_device_name

    return peak_flops_for_device_name(torch.cuda.get_device_name(device))


def mfu(tokens_per_s_per_device: float, flops_per_token: float, peak: float | None) -> float | None:
    return tokens_per_s_per_device * flops_per_token / peak if peak else None
