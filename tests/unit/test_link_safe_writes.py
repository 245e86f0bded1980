"""Checkpoint shards, the COMPLETE marker, the export and the adapter reach a local run directory through no link:
a checkpoint directory (`checkpoint_00000002/`) or a shard in it (`__0_0.distcp`) that another user planted as a
link pointing outside the run is refused in one line naming it, by the writer itself (the asynchronous upload, the
synchronous save's copy, the commit, pruning, the HF export), and what it points at is left as
it was. The checkpoints are real DCP saves of a small module; the process group is a one-process gloo group."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from types import SimpleNamespace

import pyarrow.fs as pafs
import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainlift import rundir
from trainlift.errors import UsageError
from trainlift.train.model import export
from trainlift.train.run import checkpoint
from trainlift.train.run.saving import Saver

STEP = 2
VICTIM_TEXT = "the user's own file\n"
LOCAL = pafs.LocalFileSystem()


def victim_dir(tmp_path: Path) -> Path:
    """A directory of the user's outside the run, holding one file."""
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    (outside / "keep.txt").write_text(VICTIM_TEXT)
    return outside


def outside_untouched(outside: Path) -> None:
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"]
    assert (outside / "keep.txt").read_text() == VICTIM_TEXT


def plant(run: Path, name: str, outside: Path) -> Path:
    """`run/name` as a link: a directory name to `outside`, a file name to `outside/keep.txt`."""
    link = run / name
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(outside if "." not in Path(name).name else outside / "keep.txt")
    return link


def assert_refused(error: BaseException, link: Path) -> None:
    assert isinstance(error, UsageError), repr(error)
    line = error.one_line()
    assert line.startswith(f"{link} is a symbolic link (to ") and "follows no link" in line and "\n" not in line


def staged_shard(tmp_path: Path) -> Path:
    """A rank's checkpoint part as DCP writes it into the private staging directory."""
    local = tmp_path / "staging"
    model = torch.nn.Linear(4, 3)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(local))
    (local / checkpoint.TRAINER_STATE).write_text("{}")
    (local / "rng_rank0.pt").write_bytes(b"rng")
    assert (local / "__0_0.distcp").is_file()
    return local


PLANTED = [checkpoint.dir_name(STEP), f"{checkpoint.dir_name(STEP)}/__0_0.distcp",
           f"{checkpoint.dir_name(STEP)}/.metadata"]


@pytest.mark.parametrize("name", PLANTED)
def test_the_asynchronous_upload_writes_no_shard_through_a_link(tmp_path, single_process_group, name):
    run, outside, local = tmp_path / "run", victim_dir(tmp_path), staged_shard(tmp_path)
    link = plant(run, name, outside)
    done: concurrent.futures.Future = concurrent.futures.Future()
    done.set_result(None)
    w = SimpleNamespace(rank=0, world=1, fs=LOCAL, run_path=str(run), spec=None)
    saver = Saver(w, "async")
    saver._finish(done, str(local), STEP, None)
    with pytest.raises(UsageError) as refused:
        saver.wait()
    assert_refused(refused.value, link)
    outside_untouched(outside)
    assert saver.completed() == [] and not (run / checkpoint.dir_name(STEP) / checkpoint.MARKER).exists()


def test_the_asynchronous_upload_of_a_clean_checkpoint_commits_it(tmp_path, single_process_group):
    run, local = tmp_path / "run", staged_shard(tmp_path)
    run.mkdir()
    done: concurrent.futures.Future = concurrent.futures.Future()
    done.set_result(None)
    w = SimpleNamespace(rank=0, world=1, fs=LOCAL, run_path=str(run), spec=SimpleNamespace(
        checkpoint=SimpleNamespace(keep=2)))
    shard = (local / "__0_0.distcp").read_bytes()
    saver = Saver(w, "async")
    saver._finish(done, str(local), STEP, None)
    saver.wait()
    assert saver.completed() == [STEP]
    written = run / checkpoint.dir_name(STEP)
    assert {".metadata", "__0_0.distcp", checkpoint.MARKER} <= {p.name for p in written.iterdir()}
    assert (written / "__0_0.distcp").read_bytes() == shard != b""


@pytest.mark.parametrize("name", PLANTED[:2])
def test_a_synchronous_save_writes_no_shard_through_a_planted_link(tmp_path, name):
    run, outside = tmp_path / "run", victim_dir(tmp_path)
    link = plant(run, name, outside)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    w = SimpleNamespace(rank=0, world=1, fs=LOCAL, run_path=str(run), spec=None)
    with pytest.raises(UsageError) as refused:
        Saver(w, "sync").save(model, optimizer, scheduler, STEP, 0, {"loss": 1.0})
    assert_refused(refused.value, link)
    outside_untouched(outside)


def test_a_linked_checkpoint_directory_is_not_marked_complete(tmp_path):
    run, outside = tmp_path / "run", victim_dir(tmp_path)
    for present in (".metadata", checkpoint.TRAINER_STATE, "__0_0.distcp", "rng_rank0.pt"):
        (outside / present).write_text("x")
    link = plant(run, checkpoint.dir_name(STEP), outside)
    with pytest.raises(UsageError) as refused:
        checkpoint.mark_complete(LOCAL, str(link), STEP, 1)
    assert_refused(refused.value, link)
    assert not (outside / checkpoint.MARKER).exists()


@pytest.mark.parametrize("doomed", ["pruned", "unfinished"])
def test_a_linked_checkpoint_directory_is_not_deleted_through(tmp_path, doomed):
    run, outside = tmp_path / "run", victim_dir(tmp_path)
    for step in (3, 4):
        (run / checkpoint.dir_name(step)).mkdir(parents=True)
        (run / checkpoint.dir_name(step) / checkpoint.MARKER).write_text("{}")
    if doomed == "pruned":
        (outside / checkpoint.MARKER).write_text("{}")  # complete, seen through the link
    link = plant(run, checkpoint.dir_name(1 if doomed == "pruned" else 5), outside)
    with pytest.raises(UsageError) as refused:
        if doomed == "pruned":
            checkpoint.prune(LOCAL, str(run), keep=1)
        else:
            checkpoint.remove_unfinished_after(LOCAL, str(run), 4)
    assert_refused(refused.value, link)
    assert (outside / "keep.txt").read_text() == VICTIM_TEXT


@pytest.mark.parametrize("name", ["final", "final/model-00001-of-00002.safetensors", f"final/{export.INDEX}"])
def test_the_export_writes_no_weights_through_a_link(tmp_path, name):
    run, outside = tmp_path / "run", victim_dir(tmp_path)
    link = plant(run, name, outside)
    weights = export.model_weights(torch.nn.Linear(64, 64))
    with pytest.raises(UsageError) as refused:
        export.write_weights(LOCAL, str(run / "final"), weights, torch.float32, max_file_bytes=64 * 64 * 4)
    assert_refused(refused.value, link)
    outside_untouched(outside)


def test_files_copied_into_a_run_directory_refuse_a_link_among_them(tmp_path):
    """What the export's metadata and the LoRA adapter are written with."""
    run, outside = tmp_path / "run", victim_dir(tmp_path)
    made = tmp_path / "made"
    made.mkdir()
    (made / "config.json").write_text("{}")
    (made / "tokenizer.json").write_text("{}")
    link = plant(run, "adapter/tokenizer.json", outside)
    with pytest.raises(UsageError) as refused:
        rundir.copy_into(str(made), LOCAL, str(run / "adapter"))
    assert_refused(refused.value, link)
    outside_untouched(outside)
    link.unlink()
    rundir.copy_into(str(made), LOCAL, str(run / "adapter"))
    assert sorted(p.name for p in (run / "adapter").iterdir()) == ["config.json", "tokenizer.json"]
