"""One driver per run: `<run>/driver.json` is claimed atomically, so that of two drivers starting on one run at
the same moment exactly one trains it.

On a local (or shared) disk the claim (read the record, judge it, write this driver's) runs under an exclusive
lock on `<run>/.driver.lock`; a run directory holding a link anywhere is refused first (rundir.refuse_links), and
the record is written to a fresh file renamed into place, so no write follows a link. On S3 the record is created
only if absent (If-None-Match: *), and a dead driver's record is replaced only if it is unchanged since it was read
(If-Match on its ETag). Imports neither torch nor Ray.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from trainlift.rundir import DRIVER_RECORD, open_local, refuse_links

LOCK_FILE = ".driver.lock"
PRECONDITION_CODES = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}
S3_TRIES = 5


class RunHeld(Exception):
    """A live driver holds the run: `holder` is its record."""

    def __init__(self, holder: dict[str, Any]):
        super().__init__(holder)
        self.holder = holder


def claim(uri: str, record: dict[str, Any], held: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
    """Write `record` as the run's driver record. Returns the record it replaced (one `held` judged dead), None when
    there was none; raises RunHeld when `held` judges the current holder alive."""
    if uri.startswith("s3://"):
        return _claim_s3(uri, record, held)
    return _claim_local(Path(uri), record, held)


def release(uri: str) -> None:
    """Remove the run's driver record (the run is no longer driven). Best effort: a record left behind (storage
    unreachable as the run ends) names a dead driver, which the next claim takes over."""
    if not uri.startswith("s3://"):
        with contextlib.suppress(OSError):
            (Path(uri) / DRIVER_RECORD).unlink(missing_ok=True)
        return
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = _bucket_key(uri)
    with contextlib.suppress(BotoCoreError, ClientError):
        _s3().delete_object(Bucket=bucket, Key=key)


def _claim_local(run_dir: Path, record: dict[str, Any], held) -> dict[str, Any] | None:
    run_dir.mkdir(parents=True, exist_ok=True)
    refuse_links(str(run_dir))
    path = run_dir / DRIVER_RECORD
    with open_local(str(run_dir / LOCK_FILE), append=True) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        existing = _parse(path.read_text()) if path.is_file() else None
        if existing is not None and held(existing):
            raise RunHeld(existing)
        fd, staged = tempfile.mkstemp(prefix=f".{DRIVER_RECORD}.", dir=run_dir)  # a new file: O_EXCL, no link
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(record))
        os.chmod(staged, 0o644)
        os.replace(staged, path)
        return existing


def _claim_s3(uri: str, record: dict[str, Any], held) -> dict[str, Any] | None:
    from botocore.exceptions import ClientError

    s3, (bucket, key) = _s3(), _bucket_key(uri)
    body = json.dumps(record).encode()
    existing: dict[str, Any] = {}
    for _ in range(S3_TRIES):
        try:
            s3.put_object(Bucket=bucket, Key=key, Body=body, IfNoneMatch="*")
            return None
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in PRECONDITION_CODES:
                raise
        try:
            found = s3.get_object(Bucket=bucket, Key=key)
        except ClientError:  # removed since: its driver ended; try to create it again
            continue
        existing = _parse(found["Body"].read().decode()) or {}
        if held(existing):
            raise RunHeld(existing)
        try:
            s3.put_object(Bucket=bucket, Key=key, Body=body, IfMatch=found["ETag"])
            return existing
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in PRECONDITION_CODES:
                raise
    raise RunHeld(existing)  # another driver claimed it in between, every time


def _bucket_key(uri: str) -> tuple[str, str]:
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    return bucket, f"{prefix.strip('/')}/{DRIVER_RECORD}".lstrip("/")


def _s3():
    import boto3

    return boto3.client("s3", region_name=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"))


def _parse(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None
