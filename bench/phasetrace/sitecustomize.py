"""Start-up timestamps for bench/first_step.py, in every Python process of a run, with no change to trainlift.

Active when BENCH_PHASE_LOG names a file and this directory is on PYTHONPATH (Ray's and torchrun's
worker processes inherit both). Each process appends JSON lines {"t", "pid", "role", "event"}: when it
was created, when heavy imports finished, and when trainlift's start-up functions started and ended.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

LOG = os.environ.get("BENCH_PHASE_LOG")
WATCHED_IMPORTS = {"torch", "transformers", "ray", "ray.train.v2.api.data_parallel_trainer", "typer", "trainlift.cli",
                   "trainlift.train.launch", "trainlift.train.recipe", "trainlift.doctor"}
DRIVER_CALLS = ("run_training", "prepare_model", "prepare_data", "ensure_ray", "scaling_for")
WORKER_CALLS = ("load_tokenizer", "build_model", "apply_fsdp", "resume", "evaluate", "step_batches")


def emit(event: str, **extra) -> None:
    role = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    line = json.dumps({"t": time.time(), "pid": os.getpid(), "role": role, "event": event, **extra})
    fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def process_created() -> float:
    """Wall-clock creation time of this process, from its start tick and the uptime clock (10 ms steps)."""
    with open("/proc/self/stat") as fh:
        start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as fh:
        uptime = float(fh.read().split()[0])
    return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def resident_mib() -> float:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:")) / 1024


def traced(name: str, fn, first_calls: int | None = None):
    calls = [0]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        calls[0] += 1
        if first_calls is not None and calls[0] > first_calls:
            return fn(*args, **kwargs)
        emit(f"{name} start", call=calls[0])
        try:
            return fn(*args, **kwargs)
        finally:
            emit(f"{name} end", call=calls[0])

    return wrapper


def traced_train_loop(fn):
    @functools.wraps(fn)
    def wrapper(config):
        import torch

        emit("train_loop start", torch_threads=torch.get_num_threads(), omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
             rss_mib=resident_mib())
        return fn(config)

    return wrapper


def patch(name: str, module) -> None:
    if name == "trainlift.train.launch":
        for attr in DRIVER_CALLS:
            setattr(module, attr, traced(attr, getattr(module, attr)))
        module.preflight.check = traced("preflight", module.preflight.check)
        module.progress.progress_board = traced("progress_board", module.progress.progress_board)
    elif name == "ray.train.v2.api.data_parallel_trainer":
        module.DataParallelTrainer.fit = traced("fit", module.DataParallelTrainer.fit)
    elif name == "trainlift.train.recipe":
        for attr in WORKER_CALLS:
            setattr(module, attr, traced(attr, getattr(module, attr), first_calls=2 if attr == "step_batches" else None))
        module.train_loop_per_worker = traced_train_loop(module.train_loop_per_worker)
        module.datacache.load_splits = traced("datacache.load_splits", module.datacache.load_splits)
        module.preflight.check_stack = traced("check_stack", module.preflight.check_stack)


class ImportWatch:
    """A meta-path finder that only times the watched modules' first import, then gets out of the way."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in WATCHED_IMPORTS:
            return None
        WATCHED_IMPORTS.discard(fullname)
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                exec_module = spec.loader.exec_module

                def timed_exec(module, exec_module=exec_module, fullname=fullname):
                    started = time.time()
                    exec_module(module)
                    emit(f"import {fullname}", started=started)
                    patch(fullname, module)

                spec.loader.exec_module = timed_exec
                return spec
            if spec is not None:
                return spec
        return None


if LOG:
    emit("process created", at=process_created(), argv=sys.argv[:3])
    sys.meta_path.insert(0, ImportWatch())
