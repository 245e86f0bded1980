"""Where the rows come from: `.jsonl`, `.json`, `.parquet` and `.csv` files, a directory or a glob of them,
local or on `s3://`, read as a stream of dicts in a fixed order (files sorted by path, rows in file order).

Parquet and CSV are read with pyarrow in record batches. JSON Lines are read line by line with the standard
`json` module, so a bad line is named by its line number (pyarrow's JSON reader counts rows per block).
A `.json` file holds either JSON Lines or one top-level array of objects.

Every row carries where it came from: `file:line` for JSON Lines and CSV (the header is line 1; a quoted
field spanning lines shifts the count), `file:row N` for Parquet and JSON arrays (1-based).

A location may also hold a dataset of the Hugging Face `datasets` ecosystem (hub.py): a directory saved by
`save_to_disk`, one in the hub's layout, or `hf://datasets/<org>/<name>`; its rows are `<location>:row N`.
A `SourceSpec` is one location with what chooses within it (config, split, revision) and how its rows read
(format, column mapping), and its weight in a mixture (mixture.py).
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
from typing import Any, Iterator, Sequence

import pyarrow.fs as pafs

from trainlift.errors import UsageError
from trainlift.train.data import formats, hub

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
KEYS = formats.COLUMN_KEYS  # what data.columns may rename
BATCH_ROWS = 4096


@dataclass(frozen=True)
class DataFile:
    uri: str  # as the user would write it: a local path or s3://bucket/key
    size: int
    mtime_ns: int
    dataset: bool = False  # a file of a `datasets` source: read through `datasets`, never on its own

    @property
    def suffix(self) -> str:
        return posixpath.splitext(self.uri)[1].lower()

    def filesystem(self) -> tuple[pafs.FileSystem, str]:
        return pafs.FileSystem.from_uri(self.uri) if "://" in self.uri else (pafs.LocalFileSystem(), self.uri)


def _is_glob(path: str) -> bool:
    return any(c in path for c in "*?[")


def _uri(scheme: str, path: str) -> str:
    return f"{scheme}://{path}" if scheme else path


def resolve(spec_path: str, field: str = "data.train", config: str | None = None, split: str | None = None,
            revision: str | None = None) -> list[DataFile]:
    """The data files a `data.train`/`data.eval` location names, sorted by path; for a `datasets` source, the files
    that identify it (hub.py), marked `dataset`."""
    if kind := hub.kind_of(spec_path, config, split, field):
        return [DataFile(uri, size, mtime, dataset=True)
                for uri, size, mtime in hub.files(kind, spec_path, config, split, revision, field)]
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
    return [columns.get(k, k) for k in formats.FORMAT_KEYS[fmt]]


def check_schema(files: list[DataFile], fmt: str, columns: dict[str, str], field: str = "data.train") -> None:
    """Columnar files name their columns up front: a missing one, or (auto) columns that fit no one format, fail
    before anything is read."""
    import pyarrow.parquet as pq

    for f in files:
        if f.suffix != ".parquet" or f.dataset:
            continue
        fs, path = f.filesystem()
        with fs.open_input_file(path) as fh:
            names = pq.ParquetFile(fh).schema_arrow.names
        file_fmt = formats.detect(list(rename(dict.fromkeys(names), columns)), field) if fmt == "auto" else fmt
        missing = [c for c in required_columns(file_fmt, columns) if c not in names]
        if missing:
            raise UsageError(f"{f.uri}: no column {', '.join(missing)} for data.format={file_fmt} "
                             f"(columns: {', '.join(names)})", hint="rename with data.columns, e.g. data.columns.prompt=question")


@dataclass(frozen=True)
class SourceSpec:
    """One source of rows: a location (as `data.train`/`data.eval` take it) and how to read it."""

    location: str
    fmt: str = "auto"
    columns: tuple[tuple[str, str], ...] = ()
    config: str | None = None
    split: str | None = None
    revision: str | None = None
    weight: float = 1.0
    field: str = "data.train"  # the spec field it came from, for errors: data.train, data.train[1], data.eval

    def files(self) -> list[DataFile]:
        return resolve(self.location, self.field, self.config, self.split, self.revision)

    def describe(self) -> dict[str, Any]:
        """What the spec says of this source, for the data's record."""
        return {"source": self.location, **self.choices()}

    def choices(self) -> dict[str, Any]:
        """What chooses within the data and how it reads: with its fingerprint (where the data is not: the same
        rows at another path are the same data), what keys its cache."""
        return {"config": self.config, "split": self.split, "revision": self.revision, "format": self.fmt,
                "columns": [list(pair) for pair in self.columns]}


def specs_of(value: Any, fmt: str = "auto", columns: dict[str, str] | None = None,
             field: str = "data.train") -> tuple[SourceSpec, ...]:
    """The sources a `data.train`/`data.eval` value names: a location, a mapping (the spec's `DataSource`, with
    `source` and its options), a `SourceSpec`, or a list of them (entries named `field[i]`); `fmt` and `columns`
    are the section's, for entries that set none."""
    if isinstance(value, (list, tuple)):
        return tuple(s for i, entry in enumerate(value) for s in specs_of(entry, fmt, columns, f"{field}[{i}]"))
    if isinstance(value, SourceSpec):
        return (value,)
    if isinstance(value, str):
        return (SourceSpec(value, fmt, tuple(sorted((columns or {}).items())), field=field),)
    own_columns = getattr(value, "columns", None)
    return (SourceSpec(value.source, getattr(value, "format", None) or fmt,
                       tuple(sorted((own_columns if own_columns is not None else columns or {}).items())),
                       value.config, value.split, value.revision, value.weight, field),)


def rows_of(source: SourceSpec) -> Iterator[tuple[str, Any]]:
    """(where, row) for every row of one source, in order."""
    kind = hub.kind_of(source.location, source.config, source.split, source.field)
    if kind is None:
        return iter_rows(resolve(source.location, source.field))
    return hub.rows(kind, source.location, source.config, source.split, source.revision, source.field)


def fingerprint_of(sources: Sequence[SourceSpec]) -> str:
    """What identifies the data of one split: one location's `fingerprint` when nothing chooses within it (as
    before sources had options), else a hash of every source's fingerprint, options, format and weight."""
    only = sources[0]
    if len(sources) == 1 and (only.config, only.split, only.revision) == (None, None, None):
        return fingerprint(only.files())
    parts = [{**s.choices(), "data": fingerprint(s.files()), "weight": s.weight} for s in sources]
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def check_schemas(sources: Sequence[SourceSpec]) -> None:
    """`check_schema` for each source of files (a `datasets` source is checked as its rows are read)."""
    for source in sources:
        if hub.kind_of(source.location, source.config, source.split, source.field) is None:
            check_schema(resolve(source.location, source.field), source.fmt, dict(source.columns), source.field)


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
