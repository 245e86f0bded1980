"""The model's files on this node's disk: `model.path` as a local directory, a hub id or `s3://bucket/prefix`.

A hub or S3 model is fetched once per node into `<root>/models/<name of the path>` (hub_fetch.py: the file lock,
the private cache directory, the `.partial` download renamed into place with its marker);
TRAINLIFT_MODEL_CACHE names the cache directory itself. Only the files the model needs are fetched: the weight
files that `model.safetensors.index.json` names (else `model.safetensors`), the config, generation config and
tokenizer files; other `*.safetensors` under the prefix are not read. The driver fetches the config and tokenizer
alone (`weights=False`, into `<name>.config`).

Imports neither torch nor transformers: the driver uses it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from fnmatch import fnmatch
from pathlib import Path

from trainlift import hub_fetch
from trainlift.errors import UsageError
from trainlift.hub_fetch import MARKER, STAGING_ENV, cache_name, is_complete, node_cache

CACHE_ENV = "TRAINLIFT_MODEL_CACHE"
INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# The config, generation config and tokenizer files (fnmatch patterns, as huggingface_hub's allow_patterns).
METADATA_FILES = ("config.json", "generation_config.json", "tokenizer*.json", "special_tokens_map.json",
                  "added_tokens.json", "*.model", "*.tiktoken", "vocab.*", "merges.txt", "chat_template.*")
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
    return node_cache("models", CACHE_ENV)


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
    def download(partial: Path) -> list[str]:
        return download_s3(path, partial, weights) if is_s3(path) else download_hub(path, partial, weights, revision)

    return hub_fetch.fetch_once(target, download, {"source": path, "revision": revision})


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
