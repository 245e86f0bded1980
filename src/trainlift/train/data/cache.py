"""Tokenize once, read a slice: packed rows cached as memory-mapped numpy arrays under the run's storage root.

    <run.storage>/.cache/data/<key>/
        rows-00000.npy   int32 [n, 3, seq_len]: input_ids, labels, position_ids of each packed row
        meta-00000.npy   int64 [n, 3]: real tokens, index of the first example, number of examples
        manifest.json    written last: the commit marker, with every file's size and sha256

The key is a hash of everything the rows depend on: each source's data (datasource.fingerprint), its config,
split, revision, format, column mapping and weight, the mixture's seed and size (mixture.py), the tokenizer (its
files), `seq_len`, an example limit, the objective when it is dpo (pairs are packed whole: preference.py) and VERSION
(raised whenever the packed rows of the same input would change).
The manifest also records the composition: per source, what the spec says of it, its fingerprint, its share
of the weights and how many examples were drawn from it (`composition`).

The driver builds the caches before any worker starts (`prepare_splits`): it is the one process that must read
every row anyway, to reject bad ones with `file:row` before Ray starts, and the workers then start straight onto
finished arrays instead of waiting at a barrier for rank 0. Workers only map the arrays (`load_splits`) and read the rows of their steps, so
their memory does not grow with the data set. Should a cache be missing or fail its checksums when the
workers open it, rank 0 rebuilds it while the others wait at a barrier.

On local storage a cache is built in a sibling directory and renamed into place. On `s3://` the arrays are
uploaded first, under a prefix of the build's own (`<key>/<build>/rows-00000.npy`, named by the manifest's
`prefix`), and the manifest last; each node downloads a cache once (under a file lock, into this user's
`<tmp>/trainlift-<uid>/data-cache`, refused when another user owns it or may write it) and maps its local copy.
Nothing committed is ever deleted, so two runs building one key cannot pull a cache from under each other.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow.fs as pafs

from trainlift.errors import UsageError
from trainlift.private_dir import TMPDIR_FIX, private_dir, user_temp_dir
from trainlift.train.data import examples as data, preference, source as datasource
from trainlift.train.data.mixture import Mixture

VERSION = 1
SHARD_BYTES = 32 << 20
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Split:
    """One cache's input: its data sources and everything else that shapes its packed rows."""

    sources: tuple[datasource.SourceSpec, ...]
    seq_len: int
    limit: int | None = None  # at most this many examples, counted before packing
    seed: int = 0  # with several sources: seeds the draws (mixture.py)
    mixture_size: int | None = None
    objective: str = "sft"  # dpo: whole preference pairs per row (preference.py)

    def mixture(self) -> Mixture:
        return Mixture(self.sources, self.seed, self.mixture_size, self.limit)


def splits(spec) -> dict[str, Split]:
    data = spec.data
    train = datasource.specs_of(data.train, data.format, data.columns, "data.train")
    out = {"train": Split(train, data.seq_len, None, spec.train.seed, data.mixture_size, spec.train.objective)}
    if data.eval:
        evaluation = datasource.specs_of(data.eval, data.format, data.columns, "data.eval")
        out["eval"] = Split(evaluation, data.seq_len, data.eval_examples, spec.train.seed,
                            objective=spec.train.objective)
    return out


def root_of(storage: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem and path of `<storage>/.cache/data` (`run.storage`, a local path or an s3:// URI)."""
    fs, path = pafs.FileSystem.from_uri(storage) if "://" in storage else (pafs.LocalFileSystem(), storage)
    return fs, f"{path.rstrip('/')}/.cache/data"


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")


def tokenizer_fingerprint(source: str | None, get_tokenizer: Callable[[], Any]) -> str:
    """A hash of the tokenizer's files. A local directory (`model.tokenizer`, else `model.path`) is hashed as it
    is, every top-level file but weights, so a cache that is there is found without loading transformers or the
    tokenizer; a hub id is loaded and the files `save_pretrained` writes for it are hashed."""
    digest = hashlib.sha256()

    def add_files(directory: str, names: Sequence[str]) -> None:
        for name in sorted(names):
            digest.update(name.encode())
            with open(os.path.join(directory, name), "rb") as fh:
                digest.update(fh.read())

    if source is not None and os.path.isdir(source):
        add_files(source, [e.name for e in os.scandir(source) if e.is_file() and not e.name.endswith(WEIGHT_SUFFIXES)])
        return digest.hexdigest()
    with tempfile.TemporaryDirectory(prefix="trainlift-tok-") as out:
        get_tokenizer().save_pretrained(out)
        digest.update(b"saved")
        add_files(out, os.listdir(out))
    return digest.hexdigest()


def tokenizer_source(spec) -> str | None:
    return spec.model.tokenizer or spec.model.path


def cache_key(split: Split, tokenizer_hash: str) -> str:
    mixed = len(split.sources) > 1  # one source's weight, and the seed of its draws, change nothing
    sources = [{**s.choices(), "data": datasource.fingerprint(s.files()), "weight": s.weight if mixed else None}
               for s in split.sources]
    parts = {"version": VERSION, "sources": sources, "tokenizer": tokenizer_hash, "seq_len": split.seq_len,
             "limit": split.limit, "seed": split.seed if mixed else None, "mixture_size": split.mixture_size,
             **({"objective": split.objective} if split.objective != "sft" else {})}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_shards(split: Split, tokenizer, out: str) -> dict:
    """Stream rows, tokenize, pack, and save them shard by shard; returns the manifest (not yet written)."""
    rows_per_shard = max(1, SHARD_BYTES // (3 * split.seq_len * 4))
    rows = np.empty((rows_per_shard, 3, split.seq_len), dtype=np.int32)
    meta = np.empty((rows_per_shard, 3), dtype=np.int64)
    files, shard_rows, filled, total, truncated, tokens = {}, [], 0, 0, 0, 0

    def flush():
        index = len(shard_rows)
        for name, array in ((f"rows-{index:05d}.npy", rows), (f"meta-{index:05d}.npy", meta)):
            np.save(os.path.join(out, name), array[:filled])
            files[name] = {"bytes": os.path.getsize(os.path.join(out, name)), "sha256": _sha256(os.path.join(out, name))}
        shard_rows.append(filled)

    mixture = split.mixture()
    packed = preference.packed_rows(mixture, tokenizer, split.seq_len) if split.objective == "dpo" else \
        data.pack_stream(data.typed_examples(mixture, tokenizer), split.seq_len, data.pad_id_of(tokenizer))
    for row, members, row_truncated in packed:
        if filled == rows_per_shard:
            flush()
            filled = 0
        rows[filled] = (row["input_ids"], row["labels"], row["position_ids"])
        meta[filled] = (row["num_tokens"], members[0], len(members))
        filled, total = filled + 1, total + 1
        truncated, tokens = truncated + row_truncated, tokens + row["num_tokens"]
    flush()
    return {"version": VERSION, "seq_len": split.seq_len, "rows": total, "shard_rows": shard_rows,
            "truncated": truncated, "tokens": tokens, "files": files, "sources": mixture.composition()}


def build(fs: pafs.FileSystem, root: str, key: str, split: Split, tokenizer) -> dict:
    """Build the cache for `key` and commit it: the manifest appears only once every array file is in place.
    Runs building the same key may race: a committed cache is never removed or overwritten, the loser drops
    its copy and returns the winner's manifest."""
    local = isinstance(fs, pafs.LocalFileSystem)
    if local:
        os.makedirs(root, exist_ok=True)
    build_id = uuid.uuid4().hex[:8]
    staging = os.path.join(root, f".{key}.partial-{build_id}") if local else tempfile.mkdtemp(prefix="trainlift-data-")
    os.makedirs(staging, exist_ok=True)
    try:
        manifest = {**_write_shards(split, tokenizer, staging), "key": key}
        if local:
            return _commit_local(staging, f"{root}/{key}", manifest)
        return _commit_remote(fs, staging, f"{root}/{key}", {**manifest, "prefix": f"{build_id}/"})
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _commit_local(staging: str, final: str, manifest: dict) -> dict:
    """Rename the staged directory into place. A rename onto a non-empty directory fails, so of two builders one
    wins; the other uses the winner's cache. An unsound directory in the way (a crash mid-copy) is moved aside."""
    with open(os.path.join(staging, MANIFEST), "w") as fh:
        json.dump(manifest, fh)
    for _ in range(3):
        try:
            os.rename(staging, final)
            return manifest
        except OSError:
            if (winner := verified(final, manifest["key"])) is not None:
                return winner
            aside = f"{staging}.stale"
            with contextlib.suppress(FileNotFoundError):
                os.rename(final, aside)
            shutil.rmtree(aside, ignore_errors=True)
    raise OSError(f"could not commit the data cache at {final}: it keeps changing under this run")


def _commit_remote(fs: pafs.FileSystem, staging: str, final: str, manifest: dict) -> dict:
    """Object stores have no rename: the arrays go under a prefix of this build's own, then the manifest names
    them. Nothing is deleted, so a cache that a reader has opened stays whole whichever builder writes last."""
    if (winner := read_manifest(fs, final, manifest["key"])) is not None:
        return winner
    for name in manifest["files"]:
        pafs.copy_files(os.path.join(staging, name), f"{final}/{manifest['prefix']}{name}", destination_filesystem=fs)
    with fs.open_output_stream(f"{final}/{MANIFEST}") as fh:
        fh.write(json.dumps(manifest).encode())
    return manifest


def read_manifest(fs: pafs.FileSystem, directory: str, key: str) -> dict | None:
    """The manifest of a committed cache whose files all have their recorded sizes; None otherwise. One that names
    files `build` does not write is refused (UsageError): its names become paths on this node."""
    try:
        with fs.open_input_stream(f"{directory}/{MANIFEST}") as fh:
            manifest = json.loads(fh.read())
        if manifest.get("version") != VERSION or manifest.get("key") != key:
            return None
        refuse_foreign_names(manifest, directory)
        infos = fs.get_file_info([f"{directory}/{manifest.get('prefix', '')}{name}" for name in manifest["files"]])
        sizes = [f["bytes"] for f in manifest["files"].values()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if any(i.type != pafs.FileType.File or i.size != size for i, size in zip(infos, sizes)):
        return None
    return manifest


SHARD_FILE = re.compile(r"(rows|meta)-\d{5}\.npy")
BUILD_PREFIX = re.compile(r"([0-9a-f]{8}/)?")  # `build`'s build id, on object storage


def refuse_foreign_names(manifest: dict, directory: str) -> None:
    prefix = manifest.get("prefix", "")
    foreign = [repr(name) for name in manifest["files"] if not SHARD_FILE.fullmatch(name)]
    if not (isinstance(prefix, str) and BUILD_PREFIX.fullmatch(prefix)):
        foreign.insert(0, f"prefix {prefix!r}")
    if foreign:
        raise UsageError(f"{directory}/{MANIFEST} names {', '.join(foreign)}: not a data cache trainlift wrote, so "
                         "nothing of it is read or downloaded",
                         hint=f"delete {directory} (it is built again) and check who else can write run.storage")


def verified(directory: str, key: str) -> dict | None:
    """A local cache's manifest when every file also matches its checksum (a corrupt cache is never used)."""
    manifest = read_manifest(pafs.LocalFileSystem(), directory, key)
    if manifest is None:
        return None
    ok = all(_sha256(os.path.join(directory, name)) == f["sha256"] for name, f in manifest["files"].items())
    return manifest if ok else None


def ensure(fs: pafs.FileSystem, root: str, key: str, split: Split, get_tokenizer: Callable[[], Any]) -> bool:
    """Build the cache unless a sound one is there; returns whether it was built. The tokenizer is loaded
    only to build."""
    directory = f"{root}/{key}"
    sound = verified(directory, key) if isinstance(fs, pafs.LocalFileSystem) else read_manifest(fs, directory, key)
    if sound is not None:
        return False
    build(fs, root, key, split, get_tokenizer())
    return True


def local_copy(fs: pafs.FileSystem, root: str, key: str) -> str | None:
    """A local, checksum-verified directory holding the cache: the storage itself when it is local, else a
    per-node copy downloaded once (the first worker on a node downloads it, the others wait on a file lock)."""
    if isinstance(fs, pafs.LocalFileSystem):
        return f"{root}/{key}"
    base = str(private_dir(user_temp_dir() / "data-cache", elsewhere=TMPDIR_FIX))
    target = os.path.join(base, key)
    with open(f"{target}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if verified(target, key) is not None:
            return target
        manifest = read_manifest(fs, f"{root}/{key}", key)
        if manifest is None:
            return None
        shutil.rmtree(target, ignore_errors=True)
        staging = tempfile.mkdtemp(prefix=f".{key}-", dir=base)
        for name in manifest["files"]:
            pafs.copy_files(f"{root}/{key}/{manifest.get('prefix', '')}{name}", os.path.join(staging, name),
                            source_filesystem=fs)
        with open(os.path.join(staging, MANIFEST), "w") as fh:
            json.dump({**manifest, "prefix": ""}, fh)
        os.rename(staging, target)
        return target if verified(target, key) is not None else None


class MappedRows(Sequence):
    """Packed rows read from memory-mapped shards: row i is a dict like `data.pack`'s, of numpy views."""

    def __init__(self, directory: str, manifest: dict):
        self.shards = [(np.load(os.path.join(directory, f"rows-{i:05d}.npy"), mmap_mode="r"),
                        np.load(os.path.join(directory, f"meta-{i:05d}.npy"), mmap_mode="r"))
                       for i in range(len(manifest["shard_rows"]))]
        self.per_shard = max(manifest["shard_rows"][0], 1)
        self.n = manifest["rows"]

    def __len__(self) -> int:
        return self.n

    def locate(self, i: int) -> tuple[np.ndarray, np.ndarray, int]:
        if not -self.n <= i < self.n:
            raise IndexError(i)
        shard, offset = divmod(i % self.n, self.per_shard)
        rows, meta = self.shards[shard]
        return rows, meta, offset

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        rows, meta, offset = self.locate(i)
        ids, labels, positions = rows[offset]
        return {"input_ids": ids, "labels": labels, "position_ids": positions, "num_tokens": int(meta[offset, 0])}


class MappedMembers(Sequence):
    """`Packed.examples_per_row` for mapped rows: each row's examples are consecutive."""

    def __init__(self, rows: MappedRows):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        _, meta, offset = self.rows.locate(i)
        first, count = int(meta[offset, 1]), int(meta[offset, 2])
        return list(range(first, first + count))


def open_packed(directory: str, manifest: dict) -> data.Packed:
    rows = MappedRows(directory, manifest)
    return data.Packed(rows, MappedMembers(rows), manifest["truncated"], manifest["tokens"])


def prepare_splits(spec, get_tokenizer: Callable[[], Any]) -> dict[str, dict]:
    """On the driver: each split's cache key, built when missing or unsound. Rows are checked while
    building, so bad data fails here with `file:row`; a cache that exists was checked when it was built.
    `get_tokenizer` is called only to build a cache or to hash a tokenizer that is not a local directory."""
    fs, root = root_of(spec.run.storage)
    tokenizer_hash = tokenizer_fingerprint(tokenizer_source(spec), get_tokenizer)
    out = {}
    for name, split in splits(spec).items():
        key = cache_key(split, tokenizer_hash)
        out[name] = {"key": key, "built": ensure(fs, root, key, split, get_tokenizer)}
    return out


def composition(spec, keys: dict[str, dict]) -> dict[str, list[dict]]:
    """Per split (`keys` from `prepare_splits`): its sources as its cache's manifest records them (what the spec
    says of each, its fingerprint, its share of the weights, the examples drawn from it), for the run's record."""
    fs, root = root_of(spec.run.storage)
    out = {}
    for name, entry in keys.items():
        manifest = read_manifest(fs, f"{root}/{entry['key']}", entry["key"])
        out[name] = manifest["sources"] if manifest is not None else []
    return out


def load_splits(spec, get_tokenizer: Callable[[], Any], rank: int, keys: dict[str, dict] | None = None):
    """In a worker: (train, eval or None) as mapped `data.Packed`. `keys` come from the driver's
    `prepare_splits`; without them (the recipe run on its own) they are computed here. `get_tokenizer` is
    called only when the keys must be computed or the cache built, so a start with the driver's keys skips
    loading the tokenizer."""
    import torch.distributed as dist

    fs, root = root_of(spec.run.storage)
    todo = splits(spec)
    if keys is None:
        tokenizer_hash = tokenizer_fingerprint(tokenizer_source(spec), get_tokenizer)
        keys = {name: {"key": cache_key(split, tokenizer_hash)} for name, split in todo.items()}
    if rank == 0:
        for name, split in todo.items():
            ensure(fs, root, keys[name]["key"], split, get_tokenizer)
    if dist.is_initialized():
        dist.barrier()
    packed = {}
    for name in todo:
        key = keys[name]["key"]
        directory = local_copy(fs, root, key)
        manifest = read_manifest(pafs.LocalFileSystem(), directory, key) if directory else None
        if manifest is None:
            raise RuntimeError(f"the data cache {root}/{key} is missing or incomplete after it was built")
        packed[name] = open_packed(directory, manifest)
    return packed["train"], packed.get("eval")
