"""Per-step metrics: a JSONL sink under the run's storage, throughput and MFU."""

from __future__ import annotations

import json
import os
import tempfile

import pyarrow.fs as pafs
import torch


class JsonlSink:
    """Appends one JSON object per line to <run>/metrics.jsonl.

    On a local filesystem it appends in place. On object storage it keeps a
    local copy (seeded from the existing file, so a resumed run appends) and
    uploads it on `flush()`, which the recipe calls at checkpoint and
    evaluation boundaries and at the end.
    """

    def __init__(self, fs: pafs.FileSystem, path: str):
        self.fs, self.path = fs, path
        self.local = isinstance(fs, pafs.LocalFileSystem)
        if self.local:
            self.file_path = path
        else:
            self.file_path = os.path.join(tempfile.mkdtemp(prefix="trainlift-metrics-"), "metrics.jsonl")
            if fs.get_file_info(path).type == pafs.FileType.File:
                pafs.copy_files(path, self.file_path, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
        self._fh = open(self.file_path, "a", encoding="utf-8")

    def write(self, row: dict) -> None:
        self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()

    def flush(self) -> None:
        if not self.local:
            pafs.copy_files(self.file_path, self.path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=self.fs)

    def close(self, summary: dict | None = None) -> None:
        self.flush()
        self._fh.close()


class NullSink:
    """What ranks other than 0 write to."""

    def write(self, row: dict) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self, summary: dict | None = None) -> None:
        pass


def device_peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of this GPU from the hardware catalog; None on CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    from trainlift.catalog import peak_flops_for_device_name

    return peak_flops_for_device_name(torch.cuda.get_device_name(device))


def mfu(tokens_per_s_per_device: float, flops_per_token: float, peak: float | None) -> float | None:
    return tokens_per_s_per_device * flops_per_token / peak if peak else None
