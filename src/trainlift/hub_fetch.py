"""Remote files on this node's disk, fetched once per node: the first process to take a cache directory's file lock
downloads, the others on the node wait on the lock and then read what it left.

A cache lives in `<root>/<kind>/<name of what it holds>`: the root is the node-local staging directory that the
rendered worker pods mount (TRAINLIFT_STAGING_DIR), else this user's `trainlift-<uid>` in the system's temporary
directory; an environment variable of the kind's own can name the cache directory itself. The directory trainlift
picks is this user's alone (private_dir.py). A download goes to `<name>.partial` and is renamed into place once
every file is whole, with a marker in it, so a download that was cut off is never taken for a complete one (the
next caller starts over). Each hub commit is a cache of its own.

Imports neither torch nor transformers: the driver uses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

from trainlift.private_dir import TMPDIR_FIX, private_dir, user_temp_dir

STAGING_ENV = "TRAINLIFT_STAGING_DIR"
MARKER = ".trainlift-complete"
HUB_PROBE_TIMEOUT_S = 2.0  # a connection to the hub's host; the hub client's own retries take ~40 s offline


def hub_offline_reason(timeout_s: float = HUB_PROBE_TIMEOUT_S) -> str | None:
    """Why the Hugging Face hub cannot be asked now (HF_HUB_OFFLINE set, or its host not reachable within
    `timeout_s`), or None when it answers a TCP connection. Honours HF_ENDPOINT, as the hub client does."""
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}:
        return "HF_HUB_OFFLINE is set"
    endpoint = urlsplit(constants.ENDPOINT)
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        return f"{host}:{port} is not reachable ({exc.strerror or type(exc).__name__})"
    return None


def node_cache(kind: str, env: str) -> Path:
    """`$env` as given, else `<kind>` under the staging directory or under this user's temporary one."""
    if root := os.environ.get(env):
        return Path(root)
    if staging := os.environ.get(STAGING_ENV):
        return private_dir(Path(staging) / kind, elsewhere=f"point {STAGING_ENV} or {env} elsewhere")
    return private_dir(user_temp_dir() / kind, elsewhere=f"{TMPDIR_FIX}, or set {env}")


def cache_name(path: str, revision: str | None = None) -> str:
    """Readable and unique: the path's characters that are safe in a file name, and a hash of the whole path and
    the revision."""
    path = f"{path}@{revision}" if revision else path
    readable = re.sub(r"[^A-Za-z0-9._-]+", "--", path.split("://", 1)[-1].strip("/")).strip("-.")[:80]
    return f"{readable}-{hashlib.sha256(path.encode()).hexdigest()[:12]}"


def is_complete(directory: Path) -> bool:
    return (directory / MARKER).is_file()


def fetch_once(target: Path, download: Callable[[Path], list[str]], record: dict) -> Path:
    """`target`, filled by `download(partial directory)` in this process unless another one on the node did it (or
    is doing it: wait). `download` returns the names it fetched; they go into the marker with `record`."""
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
        files = download(partial)
        (partial / MARKER).write_text(json.dumps({**record, "files": files}))
        os.replace(partial, target)
    return target
