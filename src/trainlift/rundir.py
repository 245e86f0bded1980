"""Read what a run left in its directory (local or s3://): metrics rows, the summary, its state; and write a local
run directory's files without following links.

A link in a local run directory (spec.json pointing at another file of the user's) would have trainlift overwrite
whatever it points at: trainlift writes a local run's files with O_NOFOLLOW, and refuses, in one line, a run
directory that holds a link when a driver claims it (run_lease), before anything of the run is written.

Used by `trainlift report` and `trainlift runs`; imports neither torch nor Ray.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import time
from dataclasses import dataclass
from typing import IO, Any

import pyarrow.fs as pafs

from trainlift.errors import UsageError

RUNNING_WINDOW_S = 300.0  # metrics.jsonl written this recently, and no newer summary: the run is still going
DRIVER_RECORD = "driver.json"  # {host, pid, started}: written while a driver runs the run, removed when it ends
_CHECKPOINT = re.compile(r"^checkpoint_(\d{8})$")


def open_uri(uri: str) -> tuple[pafs.FileSystem, str]:
    try:
        return pafs.FileSystem.from_uri(uri if "://" in uri else _absolute(uri))
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot open {uri} ({str(exc).splitlines()[0]})",
                         hint="give a local directory or s3://bucket/prefix; for S3 check AWS credentials, "
                              "AWS_REGION and AWS_ENDPOINT_URL") from None


def link_refused(path: str, run_dir: str | None = None) -> UsageError:
    """The one line for a link where trainlift writes a run's file."""
    try:
        target = f" (to {os.readlink(path)})"
    except OSError:
        target = ""
    return UsageError(f"{path} is a symbolic link{target}: trainlift writes a run's files itself and follows no link "
                      "in a run directory",
                      hint=f"remove the link, and check who else can write {run_dir or os.path.dirname(path)}")


def refuse_links(run_dir: str) -> None:
    """Refuse a local run directory holding a link anywhere below it (its own path may be one)."""
    for dirpath, dirnames, filenames in os.walk(run_dir):
        for name in sorted(dirnames) + sorted(filenames):
            if os.path.islink(os.path.join(dirpath, name)):
                raise link_refused(os.path.join(dirpath, name), run_dir)


def open_local(path: str, append: bool = False) -> IO[bytes]:
    """A local run file opened for writing (truncated, or appended to) without following a link at `path`:
    refused in one line when it is one."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_APPEND if append else os.O_TRUNC)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP or os.path.islink(path):
            raise link_refused(path) from None
        raise
    return os.fdopen(fd, "ab" if append else "wb")


def write_file(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    """`data` as the run file `path` on `fs`: on a local disk without following a link (`open_local`)."""
    with open_output(fs, path) as out:
        out.write(data)


def open_output(fs: pafs.FileSystem, path: str) -> IO[bytes]:
    """The run file `path` on `fs` opened for writing: on a local disk without following a link (`open_local`)."""
    if isinstance(fs, pafs.LocalFileSystem):
        return open_local(path)
    return fs.open_output_stream(path)


def refuse_link_dir(path: str, fs: pafs.FileSystem | None = None) -> None:
    """Refuse a local directory of a run (a checkpoint, the export) that is itself a link or holds one; nothing to
    refuse on another `fs` (S3 has no links)."""
    if fs is not None and not isinstance(fs, pafs.LocalFileSystem):
        return
    if os.path.islink(path):
        raise link_refused(path)
    if os.path.isdir(path):
        refuse_links(path)


def make_dir(fs: pafs.FileSystem, path: str) -> None:
    """Create the run's directory `path` on `fs`; on a local disk one that is, or holds, a link is refused."""
    if not isinstance(fs, pafs.LocalFileSystem):
        fs.create_dir(path)
        return
    refuse_link_dir(path)
    os.makedirs(path, exist_ok=True)
    refuse_link_dir(path)  # planted between the look and the mkdir


def copy_into(local_dir: str, fs: pafs.FileSystem, path: str) -> None:
    """The files of the private `local_dir` copied into the run's directory `path` on `fs` (created); on a local
    disk each written without following a link, and `path` refused when it is, or holds, one."""
    if not isinstance(fs, pafs.LocalFileSystem):
        fs.create_dir(path)
        pafs.copy_files(local_dir, path, destination_filesystem=fs)
        return
    make_dir(fs, path)
    for entry in sorted(os.scandir(local_dir), key=lambda e: e.name):
        target = os.path.join(path, entry.name)
        if entry.is_dir(follow_symlinks=False):
            copy_into(entry.path, fs, target)
        elif entry.is_file(follow_symlinks=False):
            with open(entry.path, "rb") as src, open_local(target) as out:
                shutil.copyfileobj(src, out, 2**24)


def delete_dir(fs: pafs.FileSystem, path: str) -> None:
    """Delete a directory of the run; on a local disk a link in its place is refused, not followed, and links in it
    are removed, not followed."""
    if not isinstance(fs, pafs.LocalFileSystem):
        fs.delete_dir(path)
        return
    if os.path.islink(path):
        raise link_refused(path)
    shutil.rmtree(path)


def _absolute(path: str) -> str:
    from trainlift.home import expand_user

    return str(expand_user(path).resolve())


def _read(fs: pafs.FileSystem, path: str) -> str | None:
    try:
        with fs.open_input_stream(path) as src:
            return src.read().decode()
    except (FileNotFoundError, IsADirectoryError):
        return None
    except OSError as exc:
        if fs.get_file_info(path).type == pafs.FileType.NotFound:
            return None
        raise UsageError(f"cannot read {path} ({str(exc).splitlines()[0]})") from None


def parse_rows(text: str) -> list[dict[str, Any]]:
    """metrics.jsonl lines as dicts; a torn last line (a run killed mid-write) is skipped."""
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return rows


@dataclass
class Run:
    """One run directory, read."""

    name: str
    uri: str
    rows: list[dict[str, Any]]
    summary: dict[str, Any] | None
    checkpoint_step: int | None
    metrics_mtime: float | None
    summary_mtime: float | None
    driver: dict[str, Any] | None = None


def read_run(uri: str) -> Run:
    fs, path = open_uri(uri)
    path = path.rstrip("/")
    text = _read(fs, f"{path}/metrics.jsonl")
    if text is None:
        raise UsageError(f"{uri}: no metrics.jsonl here, so this is not a trainlift run directory",
                         hint="give <run.storage>/<run.name>, e.g. runs/tiny-demo; `trainlift runs STORAGE` lists them")
    summary_text = _read(fs, f"{path}/summary.json")
    driver_text = _read(fs, f"{path}/{DRIVER_RECORD}")
    infos = {i.base_name: i for i in fs.get_file_info(pafs.FileSelector(path))}
    return Run(name=path.rsplit("/", 1)[-1], uri=uri, rows=parse_rows(text),
               summary=json.loads(summary_text) if summary_text else None,
               checkpoint_step=_latest_complete_checkpoint(fs, path, infos),
               metrics_mtime=_mtime(infos.get("metrics.jsonl")), summary_mtime=_mtime(infos.get("summary.json")),
               driver=_json_or_none(driver_text))


def read_driver(uri: str) -> dict[str, Any] | None:
    """The run's driver record, where a driver is (or was, until it died) running it."""
    fs, path = open_uri(uri)
    return _json_or_none(_read(fs, f"{path}/{DRIVER_RECORD}"))


def _json_or_none(text: str | None) -> dict[str, Any] | None:
    try:
        value = json.loads(text) if text else None
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def driver_alive(driver: dict[str, Any]) -> bool | None:
    """Whether the recorded driver process still runs: known only on its own host (None elsewhere)."""
    if driver.get("host") != socket.gethostname() or not isinstance(driver.get("pid"), int):
        return None
    try:
        os.kill(driver["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _mtime(info: pafs.FileInfo | None) -> float | None:
    return info.mtime.timestamp() if info is not None and info.mtime is not None else None


def latest_checkpoint_step(uri: str) -> int | None:
    """The step of the run's newest complete checkpoint (None: none, or no run here)."""
    fs, path = open_uri(uri)
    path = path.rstrip("/")
    if fs.get_file_info(path).type != pafs.FileType.Directory:
        return None
    return _latest_complete_checkpoint(fs, path, {i.base_name: i for i in fs.get_file_info(pafs.FileSelector(path))})


def _latest_complete_checkpoint(fs: pafs.FileSystem, path: str, infos: dict[str, pafs.FileInfo]) -> int | None:
    steps = sorted((int(m.group(1)) for name, info in infos.items()
                    if info.type == pafs.FileType.Directory and (m := _CHECKPOINT.match(name))), reverse=True)
    for step in steps:  # the same rule resuming uses: a checkpoint counts once COMPLETE is there
        if fs.get_file_info(f"{path}/checkpoint_{step:08d}/COMPLETE").type == pafs.FileType.File:
            return step
    return None


def train_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if "loss" in r]


def eval_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if "eval_loss" in r]


def total_steps(rows: list[dict[str, Any]]) -> int | None:
    starts = [r["total_steps"] for r in rows if r.get("event") == "start" and r.get("total_steps")]
    return starts[-1] if starts else None


def state(run: Run, now: float) -> str:
    """finished, running, checkpointed at step N, or no checkpoint; `(driver gone)` after those last two when the
    run's driver died without ending it (killed, its machine lost)."""
    summary_newer = run.summary_mtime is not None and (run.metrics_mtime is None or run.summary_mtime >= run.metrics_mtime - 1)
    if run.summary and run.summary.get("finished") and summary_newer:
        return "finished"
    alive = driver_alive(run.driver) if run.driver is not None else None
    recent = not summary_newer and run.metrics_mtime is not None and now - run.metrics_mtime < RUNNING_WINDOW_S
    if alive or (alive is None and run.driver is not None and recent):
        return "running"
    where = f"checkpointed at step {run.checkpoint_step}" if run.checkpoint_step is not None else "no checkpoint"
    return f"{where} (driver gone)" if run.driver is not None else where


def listing_row(run: Run, now: float) -> dict[str, Any]:
    """What `trainlift runs` shows for one run."""
    train, evals = train_rows(run.rows), eval_rows(run.rows)
    last_write = max(t for t in (run.metrics_mtime, run.summary_mtime, 0.0) if t is not None)
    return {"name": run.name, "run": run.uri, "steps": train[-1]["step"] if train else 0,
            "total_steps": total_steps(run.rows), "loss": train[-1]["loss"] if train else None,
            "eval_loss": evals[-1]["eval_loss"] if evals and evals[-1]["step"] > 0 else None,  # not the step-0 baseline
            "state": state(run, now),
            "age_s": round(now - last_write, 1) if last_write else None}


def list_runs(storage: str) -> list[dict[str, Any]]:
    """Every run directory (one holding metrics.jsonl) directly under `storage`, newest first."""
    fs, root = open_uri(storage)
    root = root.rstrip("/")
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        raise UsageError(f"{storage}: no such directory", hint="give the run.storage of your job spec, e.g. runs")
    now, found = time.time(), []
    for child in fs.get_file_info(pafs.FileSelector(root)):
        if child.type != pafs.FileType.Directory:
            continue
        if fs.get_file_info(f"{child.path}/metrics.jsonl").type != pafs.FileType.File:
            continue
        uri = f"{storage.rstrip('/')}/{child.base_name}"
        found.append(listing_row(read_run(uri), now))
    return sorted(found, key=lambda r: (r["age_s"] is None, r["age_s"]))
