"""trainlift as a wheel for a Ray cluster's runtime_env `py_modules`.

The cluster's image has no trainlift, so every job brings it. A wheel is the form Ray installs
as is (`pip install --target` on each node) whatever the protocol: a zip with one top-level
folder loses that folder when it comes from s3:// (Ray unpacks the folder's contents), and a
directory in py_modules is filtered by the job's `excludes`, i.e. by the user's .gitignore.

The wheel declares no dependencies (pip must not replace the image's torch or ray) and is
reproducible: sorted entries, fixed timestamps and modes. Ray caches a wheel on every node by its
file name, so the name carries a hash of the content as the wheel's build tag
(`trainlift-0.1.0-<digits>-py3-none-any.whl`; digits only: a `+` in the name reaches pip
percent-encoded from a URI): new code, new name.
"""

from __future__ import annotations

import base64
import hashlib
import os
import zipfile
from pathlib import Path

import trainlift
from trainlift.errors import UsageError
from trainlift.home import trainlift_home

WHEEL_TAG = "py3-none-any"
_SKIPPED_DIRS = {"__pycache__"}
_SKIPPED_SUFFIXES = {".pyc", ".pyo"}
_EPOCH = (1980, 1, 1, 0, 0, 0)  # the earliest time a zip entry can hold
_FILE_MODE = 0o644 << 16


def default_dir() -> Path:
    return trainlift_home() / "packages"


def source_dir() -> Path:
    return Path(trainlift.__file__).resolve().parent


def package_files(source: Path) -> list[tuple[str, bytes]]:
    """(name inside the wheel, content) for every file of the package, sorted by name."""
    files = []
    for path in source.rglob("*"):
        rel = path.relative_to(source)
        if path.is_file() and not _SKIPPED_DIRS & set(rel.parts) and path.suffix not in _SKIPPED_SUFFIXES:
            files.append((f"trainlift/{rel.as_posix()}", path.read_bytes()))
    return sorted(files)


def content_tag(files: list[tuple[str, bytes]]) -> str:
    """The wheel's build tag: 15 decimal digits of a hash of every name and content."""
    digest = hashlib.sha256()
    for name, data in files:
        digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return str(int(digest.hexdigest(), 16))[:15]


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _dist_info(version: str, build: str, files: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    info = f"trainlift-{version}.dist-info"
    metadata = (f"Metadata-Version: 2.1\nName: trainlift\nVersion: {version}\n"
                "Summary: trainlift for a Ray cluster's runtime_env (the image provides its dependencies)\n"
                "Requires-Python: >=3.10\n")
    wheel = (f"Wheel-Version: 1.0\nGenerator: trainlift package\nRoot-Is-Purelib: true\nBuild: {build}\n"
             f"Tag: {WHEEL_TAG}\n")
    meta = [(f"{info}/METADATA", metadata.encode()), (f"{info}/WHEEL", wheel.encode())]
    record = [_record_line(name, data) for name, data in files + meta] + [f"{info}/RECORD,,"]
    return meta + [(f"{info}/RECORD", ("\n".join(record) + "\n").encode())]


def build_wheel(out_dir: str | Path, source: Path | None = None) -> Path:
    """Write the wheel of the trainlift package at `source` (default: this one) into `out_dir`."""
    files = package_files(source or source_dir())
    version, build = trainlift.__version__, content_tag(files)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    wheel = out / f"trainlift-{version}-{build}-{WHEEL_TAG}.whl"
    partial = out / f".{wheel.name}.{os.getpid()}.partial"  # two submits at once do not share a half-written file
    with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        for name, data in files + _dist_info(version, build, files):
            entry = zipfile.ZipInfo(name, date_time=_EPOCH)
            entry.external_attr = _FILE_MODE
            entry.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(entry, data)
    partial.replace(wheel)
    return wheel


def s3_destination(prefix: str, wheel_name: str) -> tuple[str, str]:
    """(bucket, key) for the wheel under an s3:// folder; the wheel keeps its content-addressed name."""
    bucket, _, folder = prefix.removeprefix("s3://").partition("/")
    if not prefix.startswith("s3://") or not bucket or folder.endswith(".whl"):
        raise UsageError(f"--upload {prefix}: expected an S3 folder such as s3://bucket/code/",
                         hint="the wheel keeps its own name: Ray caches it on each node by that name")
    folder = folder.strip("/")
    return bucket, f"{folder}/{wheel_name}" if folder else wheel_name


def upload(wheel: Path, prefix: str, region: str | None = None) -> str:
    """Put the wheel under the S3 folder `prefix`; returns its s3:// URI for runtime_env py_modules."""
    from trainlift.cloud.aws import Aws

    bucket, key = s3_destination(prefix, wheel.name)
    region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    Aws(region).put_file(wheel, bucket, key)  # S3 follows a bucket in another region by itself
    return f"s3://{bucket}/{key}"
