"""Writing checkpoints: `checkpoint.mode` sync, or async (the default), which holds the loop only while the state
is copied to host memory.

sync: every rank writes its part to the staging directory and copies it to run storage, a barrier, then rank 0
writes COMPLETE. The loop waits for all of it.

async: `dcp.async_save` copies the state to host memory (the only time the loop waits) and hands it to DCP's
process-based checkpointer (`AsyncCheckpointerType.PROCESS`: a process per rank, so the write takes neither the
GIL nor the loop's process group). A thread per rank then uploads the files to run storage, and rank 0 writes
COMPLETE once every rank's upload has succeeded (a min all-reduce on a gloo group of the saver's own). At most
one save is in flight: the next save, a stop and the end of the run wait for it first, and an error in it is
raised there. A kill during a save leaves no COMPLETE, so the previous checkpoint stays the latest.

Neither mode hands the files to Ray Train's upload: it follows links on a local disk (the copy here writes through
none), and its `CheckpointUploadMode.ASYNC` ends each rank's upload on its own thread, with nothing to tell a rank
when all of them have, which is when COMPLETE may be written. The recipe resumes from what storage holds
(`checkpoint.latest_complete`), not from Ray Train's list.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time

import torch
import torch.distributed as dist

from trainlift import rundir
from trainlift.train.model.fetch import staging_root
from trainlift.train.run import checkpoint

log = logging.getLogger(__name__)


class Saver:
    """Saves checkpoints of one worker; `completed()` hands back the steps whose checkpoints are COMPLETE."""

    def __init__(self, w, mode: str):
        self.w, self.mode = w, mode
        self.group = dist.new_group(backend="gloo") if mode == "async" else None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._done: list[int] = []
        self._lock = threading.Lock()

    def save(self, model, optimizer, scheduler, step: int, cursor: int, metrics: dict) -> float:
        """Start (async) or make (sync) the checkpoint of `step`; returns the seconds the loop was held."""
        started = time.perf_counter()
        if self.mode == "sync":
            self._save_sync(model, optimizer, scheduler, step, cursor, metrics)
        else:
            self._start_async(model, optimizer, scheduler, step, cursor, metrics)
        return time.perf_counter() - started

    def wait(self) -> None:
        """Until the save in flight is complete in storage; raises what went wrong with it."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def completed(self) -> list[int]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def _save_sync(self, model, optimizer, scheduler, step, cursor, metrics) -> None:
        import ray.train

        w = self.w
        with tempfile.TemporaryDirectory(prefix="trainlift-ckpt-", dir=staging_root()) as local_dir:
            checkpoint.write_shard(local_dir, model, optimizer, scheduler, step, cursor, w.rank, w.world)
            rundir.copy_into(local_dir, w.fs, f"{w.run_path}/{checkpoint.dir_name(step)}")  # on a local disk through no link
        ray.train.report(metrics)
        dist.barrier()  # every rank's copy has finished before the marker goes down
        if w.rank == 0:
            self._commit(step)
        with self._lock:
            self._done.append(step)

    def _start_async(self, model, optimizer, scheduler, step, cursor, metrics) -> None:
        import ray.train

        self.wait()
        w = self.w
        local_dir = tempfile.mkdtemp(prefix="trainlift-ckpt-", dir=staging_root())
        written, stager = start_write(local_dir, model, optimizer, self.group, w.device)
        checkpoint.write_extras(local_dir, model, scheduler, step, cursor, w.rank, w.world)
        ray.train.report(metrics)
        self._thread = threading.Thread(target=self._finish, args=(written, local_dir, step, stager),
                                        name=f"trainlift-checkpoint-{step}", daemon=True)
        self._thread.start()

    def _finish(self, written, local_dir: str, step: int, stager) -> None:
        """On the saver's thread: wait for the write, upload, agree that every rank's upload succeeded, commit."""
        w = self.w
        path = f"{w.run_path}/{checkpoint.dir_name(step)}"
        ok = True
        try:
            written.result()
            rundir.copy_into(local_dir, w.fs, path)  # on a local disk through no link
        except BaseException as exc:  # noqa: BLE001 - raised on the training thread by wait()
            self._error, ok = exc, False
        finally:
            shutil.rmtree(local_dir, ignore_errors=True)
            if stager is not None:
                stager.close()
        try:
            every_rank_ok = torch.tensor([int(ok)])
            dist.all_reduce(every_rank_ok, op=dist.ReduceOp.MIN, group=self.group)
            if every_rank_ok.item() and w.rank == 0:
                self._commit(step)
            if every_rank_ok.item():
                with self._lock:
                    self._done.append(step)
        except BaseException as exc:  # noqa: BLE001
            self._error = self._error or exc

    def _commit(self, step: int) -> None:
        w = self.w
        checkpoint.mark_complete(w.fs, f"{w.run_path}/{checkpoint.dir_name(step)}", step, w.world)
        checkpoint.prune(w.fs, w.run_path, w.spec.checkpoint.keep)


def start_write(local_dir: str, model, optimizer, group, device):
    """`dcp.async_save` of this rank's trainable state into `local_dir` by DCP's process-based checkpointer; returns
    once the state is in host memory, with (the write's future, the stager to close once it is written)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    model_sd, optim_sd = checkpoint.trainable_state(model, optimizer)
    stager = host_stager(device, state_bytes(model_sd) + state_bytes(optim_sd))
    written = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=local_dir, process_group=group,
                             async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=stager)
    return written, stager


def host_stager(device, staged_bytes: int = 0):
    """On a GPU, a stager that copies the state into pinned host memory with non-blocking copies, shared (the
    checkpointing process then reads it without another copy) where /dev/shm has room for every rank of the node;
    elsewhere None: DCP's default stager copies to ordinary host memory. One per save, closed once it is written:
    torch 2.11's DefaultStager cannot be reused across saves (pytorch/pytorch#183413)."""
    if device.type != "cuda":
        return None
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    shared = shared_memory_fits(staged_bytes, local_ranks(), shm_free_bytes())
    return DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=shared, use_async_staging=False,
                                        use_non_blocking_copy=True))


SHM = "/dev/shm"
SHM_MARGIN = 1.1  # Ray's object store lives in /dev/shm too, and grows after this look


def shared_memory_fits(staged_bytes: int, ranks: int, free_bytes: int | None) -> bool:
    """Whether every rank of the node can stage its state in /dev/shm at once; said once when not (on EKS
    /dev/shm is the pod's memory-backed volume, which render sizes; a container runtime's default is 64 MiB)."""
    need = staged_bytes * ranks * SHM_MARGIN
    if free_bytes is None or need <= free_bytes:
        return free_bytes is not None
    if not _said_shm:
        _said_shm.append(True)
        log.warning("checkpoint staging: %s has %.1f GiB free, %d rank(s) of this node stage %.1f GiB each: staging in "
                    "private pinned memory instead (the checkpoint process gets a copy); give the pod a larger %s",
                    SHM, free_bytes / 2**30, ranks, staged_bytes / 2**30, SHM)
    return False


_said_shm: list[bool] = []


def shm_free_bytes() -> int | None:
    try:
        found = os.statvfs(SHM)
    except OSError:
        return None
    return found.f_bavail * found.f_frsize


def local_ranks() -> int:
    """Workers on this node, as torch's launchers and Ray Train's torch backend set them."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def state_bytes(state: dict) -> int:
    """This rank's share of a state dict: a DTensor counts its local shard."""
    total = 0
    for value in state.values():
        if isinstance(value, dict):
            total += state_bytes(value)
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            total += local.numel() * local.element_size()
    return total
