"""The model's files on this node's disk: `model.path` as a local directory, a hub id or `s3://bucket/prefix`.

A hub or S3 model is fetched once per node, not once per rank: the first process to get the cache directory's
file lock downloads, the others on the node wait on the lock and then read what it left. Only the files the model
needs are fetched: the weight files that `model.safetensors.index.json` names (else `model.safetensors`), the
config, generation config and tokenizer files; other `*.safetensors` under the prefix are not read.

The cache is `<root>/models/<name of the path>`: the root is the node-local staging directory that the rendered
worker pods mount (TRAINLIFT_STAGING_DIR), else this user's `trainlift-<uid>` in the system's temporary directory;
TRAINLIFT_MODEL_CACHE names the cache directory itself. The `models` directory trainlift picks is this user's alone
(private_dir.py): one another user owns or may write is refused, not read. A download goes to `<name>.partial`
and is renamed into place once every file is whole, with a marker in it, so a download that was cut off is never
taken for a complete one (the next caller starts over).
The driver fetches the config and tokenizer alone (`weights=False`, into `<name>.config`).

Imports neither torch nor transformers: the driver uses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from fnmatch import fnmatch
from pathlib import Path

from trainlift.errors import UsageError
from trainlift.private_dir import TMPDIR_FIX, private_dir, user_temp_dir

# Where a worker stages checkpoints before their upload, and keeps this cache: the rendered worker pods mount the
# node's local NVMe there; elsewhere it is the system's temporary directory.
STAGING_ENV = "TRAINLIFT_STAGING_DIR"
CACHE_ENV = "TRAINLIFT_MODEL_CACHE"
INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# The config, generation config and tokenizer files (fnmatch patterns, as huggingface_hub's allow_patterns).
METADATA_FILES = ("config.json", "generation_config.json", "tokenizer*.json", "special_tokens_map.json",
                  "added_tokens.json", "*.model", "*.tiktoken", "vocab.*", "merges.txt", "chat_template.*")
MARKER = ".trainlift-complete"
_CHUNK = 64 << 20


def is_s3(path: str) -> bool:
    return path.startswith("s3://")


def is_local(path: str) -> bool:
    """A directory on this machine (anything else that is not s3:// is a hub id)."""
    return not is_s3(path) and Path(path).expanduser().is_dir()


def staging_root() -> str:
    return os.environ.get(STAGING_ENV) or tempfile.gettempdir()


def cache_root() -> Path:
    """TRAINLIFT_MODEL_CACHE as given, else `models` under the staging directory or this user's temporary one."""
    if root := os.environ.get(CACHE_ENV):
        return Path(root)
    if staging := os.environ.get(STAGING_ENV):
        return private_dir(Path(staging) / "models", elsewhere=f"point {STAGING_ENV} or {CACHE_ENV} elsewhere")
    return private_dir(user_temp_dir() / "models", elsewhere=f"{TMPDIR_FIX}, or set {CACHE_ENV}")


def cache_name(path: str, revision: str | None = None) -> str:
    """Readable and unique: the path's characters that are safe in a file name, and a hash of the whole path and
    the revision (each commit of a hub model is a cache of its own)."""
    path = f"{path}@{revision}" if revision else path
    readable = re.sub(r"[^A-Za-z0-9._-]+", "--", path.split("://", 1)[-1].strip("/")).strip("-.")[:80]
    return f"{readable}-{hashlib.sha256(path.encode()).hexdigest()[:12]}"


def is_complete(directory: Path) -> bool:
    return (directory / MARKER).is_file()


def model_dir(path: str, weights: bool = True, revision: str | None = None) -> Path:
    """A local directory holding the model's files: `path` itself when it is one, else this node's cache of it,
    fetched first when it is not there yet (a hub model at `revision`, a commit, when given). `weights=False`: the
    config and tokenizer files are enough (a complete cache with the weights serves too)."""
    if is_local(path):
        return Path(path).expanduser()
    full = cache_root() / cache_name(path, revision)
    if is_complete(full) or weights:
        return fetch_once(path, full, weights=True, revision=revision)
    return fetch_once(path, full.with_name(full.name + ".config"), weights=False, revision=revision)


def cached_dir(path: str, revision: str | None = None) -> Path | None:
    """The model's files already on this node (the local directory, or a complete cache of it), without fetching
    anything; None when there are none (a local model.path deleted since, a cache never filled here)."""
    if is_local(path):
        return Path(path).expanduser()
    full = cache_root() / cache_name(path, revision)
    found = [d for d in (full, full.with_name(full.name + ".config")) if is_complete(d)]
    return found[0] if found else None


def fetch_once(path: str, target: Path, weights: bool, revision: str | None = None) -> Path:
    """`target`, downloaded by this process unless another one on the node did it (or is doing it: wait)."""
    from filelock import FileLock

    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if is_complete(target):  # another process finished it while this one waited
            return target
        partial = target.with_name(target.name + ".partial")
        for leftover in (partial, target):  # a cut-off download, or a directory without the marker
            shutil.rmtree(leftover, ignore_errors=True)
        partial.mkdir()
        files = download_s3(path, partial, weights) if is_s3(path) else download_hub(path, partial, weights, revision)
        (partial / MARKER).write_text(json.dumps({"source": path, "revision": revision, "files": files}))
        os.replace(partial, target)
    return target


def weight_files(directory: Path) -> list[str]:
    """The safetensors files the index in `directory` names, else the single-file name."""
    index = directory / INDEX
    if not index.is_file():
        return [SINGLE_FILE]
    return sorted(set(json.loads(index.read_text())["weight_map"].values()))


def download_hub(repo: str, out: Path, weights: bool, revision: str | None = None) -> list[str]:
    """The metadata files of hub repo `repo` at `revision` (None: its main branch now) and its index, then the
    weight files the index names, from the same commit."""
    from huggingface_hub import snapshot_download

    snapshot_download(repo, revision=revision, local_dir=out, allow_patterns=[*METADATA_FILES, INDEX])
    if weights:
        snapshot_download(repo, revision=revision, local_dir=out, allow_patterns=weight_files(out))
    shutil.rmtree(out / ".cache", ignore_errors=True)  # huggingface_hub's bookkeeping of the local dir
    return sorted(p.name for p in out.iterdir())


def download_s3(uri: str, out: Path, weights: bool) -> list[str]:
    """The metadata files under `uri` (one listing tells which exist) and, with `weights`, the index and the
    weight files it names; each is checked against its listed size."""
    import pyarrow.fs as pafs

    try:
        fs, prefix = pafs.FileSystem.from_uri(uri.rstrip("/"))
        listed = {info.base_name: info.size for info in fs.get_file_info(pafs.FileSelector(prefix))
                  if info.type == pafs.FileType.File}
    except (OSError, ValueError) as exc:
        raise UsageError(f"model.path: cannot list {uri} ({str(exc).splitlines()[0]})",
                         hint="check the URI, AWS credentials, AWS_REGION and AWS_ENDPOINT_URL") from None
    wanted = sorted(name for name in listed if any(fnmatch(name, p) for p in (*METADATA_FILES, INDEX)))
    if "config.json" not in listed:
        raise UsageError(f"model.path: {uri} holds no config.json",
                         hint="upload the whole save_pretrained directory under that prefix")
    for name in wanted:
        _copy(fs, f"{prefix}/{name}", staged(out, name, uri), listed[name])
    if weights:
        files = {name: staged(out, name, uri) for name in weight_files(out)}
        missing = [name for name in files if name not in listed]
        if missing:
            raise UsageError(f"model.path: {uri} lacks {', '.join(missing)}",
                             hint="upload every file that model.safetensors.index.json names")
        for name, destination in files.items():
            _copy(fs, f"{prefix}/{name}", destination, listed[name])
            wanted.append(name)
    return wanted


def staged(out: Path, name: str, uri: str) -> Path:
    """`out / name`, refused unless that is a file directly in `out`: the names come from the bucket (its listing
    and the weight map of its index)."""
    path = out / name
    if name in ("", ".", "..") or path.resolve().parent != out.resolve():
        raise UsageError(f"model.path: {uri} names {name!r} (in {INDEX} or its listing), which is not a file of "
                         "that folder, so nothing is downloaded",
                         hint=f"the weight map of {INDEX} names files beside it; fix it, and check who else can "
                              "write that bucket")
    return path


def _copy(fs, source: str, destination: Path, size: int) -> None:
    with fs.open_input_stream(source) as src, open(destination, "wb") as dst:
        while chunk := src.read(_CHUNK):
            dst.write(chunk)
    if destination.stat().st_size != size:
        raise OSError(f"{source}: fetched {destination.stat().st_size} of {size} bytes")
