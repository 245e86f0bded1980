"""Where the rows come from: `.jsonl`, `.json`, `.parquet` and `.csv` files, a directory or a glob of them,
local or on `s3://`, read as a stream of dicts in a fixed order (files sorted by path, rows in file order).

Parquet and CSV are read with pyarrow in record batches. JSON Lines are read line by line with the standard
`json` module, so a bad line is named by its line number (pyarrow's JSON reader counts rows per block).
A `.json` file holds either JSON Lines or one top-level array of objects.

Every row carries where it came from: `file:line` for JSON Lines and CSV (the header is line 1; a quoted
field spanning lines shifts the count), `file:row N` for Parquet and JSON arrays (1-based).
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import io
import json
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pyarrow.fs as pafs

from trainlift.errors import UsageError

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
KEYS = ("messages", "prompt", "completion", "text")  # what data.columns may rename
BATCH_ROWS = 4096


@dataclass(frozen=True)
class DataFile:
    uri: str  # as the user would write it: a local path or s3://bucket/key
    size: int
    mtime_ns: int

    @property
    def suffix(self) -> str:
        return posixpath.splitext(self.uri)[1].lower()

    def filesystem(self) -> tuple[pafs.FileSystem, str]:
        return pafs.FileSystem.from_uri(self.uri) if "://" in self.uri else (pafs.LocalFileSystem(), self.uri)


def _is_glob(path: str) -> bool:
    return any(c in path for c in "*?[")


def _uri(scheme: str, path: str) -> str:
    return f"{scheme}://{path}" if scheme else path


def resolve(spec_path: str, field: str = "data.train") -> list[DataFile]:
    """The data files a `data.train`/`data.eval` value names, sorted by path."""
    scheme = spec_path.split("://", 1)[0] if "://" in spec_path else ""
    try:
        fs, path = pafs.FileSystem.from_uri(spec_path) if scheme else (pafs.LocalFileSystem(), str(Path(spec_path)))
        if _is_glob(path):
            base = posixpath.dirname(path.split("*")[0].split("?")[0].split("[")[0]) or "."
            infos = [i for i in fs.get_file_info(pafs.FileSelector(base, recursive="**" in path))
                     if i.type == pafs.FileType.File and fnmatch.fnmatch(i.path, path)]
        else:
            info = fs.get_file_info(path)
            if info.type == pafs.FileType.Directory:
                infos = [i for i in fs.get_file_info(pafs.FileSelector(path, recursive=True))
                         if i.type == pafs.FileType.File and not posixpath.basename(i.path).startswith((".", "_"))]
            else:
                infos = [info] if info.type == pafs.FileType.File else []
    except (OSError, ValueError) as exc:
        raise UsageError(f"{field}: cannot read {spec_path} ({str(exc).splitlines()[0]})",
                         hint="check the path and, for s3://, AWS credentials and AWS_ENDPOINT_URL") from None
    files = sorted((i for i in infos if posixpath.splitext(i.path)[1].lower() in SUFFIXES), key=lambda i: i.path)
    if not files:
        what = "data file not found" if not infos else f"no {'/'.join(SUFFIXES)} files"
        raise UsageError(f"{field}: {what}: {spec_path}", hint="fix the path in the spec or with --set")
    return [DataFile(_uri(scheme, i.path), i.size, i.mtime_ns or 0) for i in files]


def fingerprint(files: list[DataFile]) -> str:
    """What identifies the data: local files by their content (sha256); S3 objects by URI, size and
    modification time (an object is rewritten whole, so any change moves its time) to avoid downloading
    the whole data set at every start just to hash it. Hashed once per process for files of the same size and
    modification time (the run's spec record and the data cache both ask)."""
    return _fingerprint(tuple(files))


@functools.lru_cache(maxsize=16)
def _fingerprint(files: tuple[DataFile, ...]) -> str:
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.uri.encode() if "://" in f.uri else posixpath.basename(f.uri).encode())
        if "://" in f.uri:
            digest.update(f"{f.size}:{f.mtime_ns}".encode())
            continue
        with open(f.uri, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def required_columns(fmt: str, columns: dict[str, str]) -> list[str]:
    keys = {"messages": ["messages"], "prompt_completion": ["prompt", "completion"], "text": ["text"]}[fmt]
    return [columns.get(k, k) for k in keys]


def check_schema(files: list[DataFile], fmt: str, columns: dict[str, str]) -> None:
    """Columnar files name their columns up front: a missing one fails before anything is read."""
    import pyarrow.parquet as pq

    need = required_columns(fmt, columns)
    for f in files:
        if f.suffix != ".parquet":
            continue
        fs, path = f.filesystem()
        with fs.open_input_file(path) as fh:
            names = pq.ParquetFile(fh).schema_arrow.names
        missing = [c for c in need if c not in names]
        if missing:
            raise UsageError(f"{f.uri}: no column {', '.join(missing)} for data.format={fmt} (columns: {', '.join(names)})",
                             hint="rename with data.columns, e.g. data.columns.prompt=question")


def rename(row: dict[str, Any], columns: dict[str, str]) -> dict[str, Any]:
    """A row under the names the formats use (`data.columns` maps those names to the user's)."""
    if not columns or not isinstance(row, dict):
        return row
    renamed = set(columns.values())
    out = {k: v for k, v in row.items() if k not in renamed}
    out.update((key, row[column]) for key, column in columns.items() if column in row)
    return out


def iter_rows(files: list[DataFile]) -> Iterator[tuple[str, Any]]:
    """(where, row) for every row of every file, in order."""
    for f in files:
        reader = {".jsonl": _jsonl_rows, ".json": _json_rows, ".parquet": _parquet_rows, ".csv": _csv_rows}[f.suffix]
        yield from reader(f)


def _jsonl_rows(f: DataFile, stream=None) -> Iterator[tuple[str, Any]]:
    fs, path = f.filesystem()
    with (stream or fs.open_input_stream(path)) as raw:
        for lineno, line in enumerate(io.TextIOWrapper(raw, encoding="utf-8"), 1):
            if not line.strip():
                continue
            try:
                yield f"{f.uri}:{lineno}", json.loads(line)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{f.uri}:{lineno}: not valid JSON ({exc.msg})") from None


def _json_rows(f: DataFile) -> Iterator[tuple[str, Any]]:
    fs, path = f.filesystem()
    with fs.open_input_stream(path) as raw:
        text = raw.read().decode("utf-8")
    if not text.lstrip().startswith("["):
        yield from _jsonl_rows(f, stream=_text_stream(text))
        return
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{f.uri}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    for i, row in enumerate(rows, 1):
        yield f"{f.uri}:row {i}", row


def _text_stream(text: str):
    import pyarrow as pa

    return pa.input_stream(pa.py_buffer(text.encode("utf-8")))


def _parquet_rows(f: DataFile) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    fs, path = f.filesystem()
    with fs.open_input_file(path) as fh:
        n = 0
        for batch in pq.ParquetFile(fh).iter_batches(batch_size=BATCH_ROWS):
            for row in batch.to_pylist():
                n += 1
                yield f"{f.uri}:row {n}", row


def _csv_rows(f: DataFile) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.csv as pcsv

    fs, path = f.filesystem()
    # Every column as text: a column of digits is still a prompt, and an empty field stays "" (not null).
    with fs.open_input_stream(path) as raw:
        try:
            reader = pcsv.open_csv(raw, convert_options=pcsv.ConvertOptions(
                column_types=_all_text(fs, path), strings_can_be_null=False))
            line = 1
            for batch in reader:
                for row in batch.to_pylist():
                    line += 1
                    yield f"{f.uri}:{line}", row
        except pa.ArrowInvalid as exc:
            raise UsageError(f"{f.uri}: not valid CSV ({str(exc).splitlines()[0]})") from None


def _all_text(fs: pafs.FileSystem, path: str) -> dict[str, Any]:
    import pyarrow as pa
    import pyarrow.csv as pcsv

    with fs.open_input_stream(path) as raw:
        reader = pcsv.open_csv(raw, read_options=pcsv.ReadOptions(block_size=1 << 16))
        return {name: pa.string() for name in reader.schema.names}
