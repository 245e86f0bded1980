"""Checkpoint bookkeeping on a real filesystem: only complete checkpoints count, pruning is safe."""

from pathlib import Path

import pyarrow.fs as pafs
import pytest

from trainlift.train.run import checkpoint

FS = pafs.LocalFileSystem()
SHARDS = (".metadata", "__0_0.distcp", "__1_0.distcp", checkpoint.TRAINER_STATE, "rng_rank0.pt", "rng_rank1.pt")


def make(run, step, complete):
    """A checkpoint directory of a 2-rank save: every file on disk, plus the marker when `complete`."""
    path = run / checkpoint.dir_name(step)
    path.mkdir(parents=True)
    for name in SHARDS:
        (path / name).write_bytes(b"x")
    if complete:
        checkpoint.mark_complete(FS, str(path), step, world_size=2)
    return path


def test_half_written_checkpoint_is_never_the_latest(tmp_path):
    make(tmp_path, 10, complete=True)
    make(tmp_path, 20, complete=False)
    assert checkpoint.latest_complete(FS, str(tmp_path)) == (10, str(tmp_path / "checkpoint_00000010"))


def test_no_checkpoints_means_start_from_scratch(tmp_path):
    assert checkpoint.latest_complete(FS, str(tmp_path / "missing")) is None


def test_prune_keeps_the_newest_complete_and_drops_stale_partials(tmp_path):
    for step in (10, 20, 30):
        make(tmp_path, step, complete=True)
    make(tmp_path, 15, complete=False)
    make(tmp_path, 40, complete=False)
    checkpoint.prune(FS, str(tmp_path), keep=2)
    left = [(s, done) for s, _, done in checkpoint.list_checkpoints(FS, str(tmp_path))]
    assert left == [(20, True), (30, True), (40, False)]


def test_unfinished_checkpoints_past_the_resume_point_are_removed(tmp_path):
    make(tmp_path, 10, complete=True)
    make(tmp_path, 20, complete=False)
    checkpoint.remove_unfinished_after(FS, str(tmp_path), 10)
    assert [s for s, _, _ in checkpoint.list_checkpoints(FS, str(tmp_path))] == [10]


def test_other_directories_are_ignored(tmp_path):
    (tmp_path / "final").mkdir()
    (tmp_path / "checkpoint_abc").mkdir()
    make(tmp_path, 5, complete=True)
    assert [s for s, _, _ in checkpoint.list_checkpoints(FS, str(tmp_path))] == [5]


def test_every_shard_without_the_marker_still_is_not_a_checkpoint(tmp_path):
    """A save killed between the shard upload and the marker looks whole on disk; it must not be resumed from."""
    make(tmp_path, 3, complete=False)
    assert checkpoint.latest_complete(FS, str(tmp_path)) is None
    make(tmp_path, 6, complete=True)
    make(tmp_path, 9, complete=False)
    assert checkpoint.latest_complete(FS, str(tmp_path)) == (6, str(tmp_path / "checkpoint_00000006"))


def test_prune_keep_1_keeps_the_newest_complete_while_a_newer_save_is_unfinished(tmp_path):
    """keep=1 with a save in flight (or killed) past it: the only checkpoint a restart can use survives,
    and so does the newer directory, which may still be receiving shards."""
    make(tmp_path, 3, complete=True)
    make(tmp_path, 6, complete=True)
    make(tmp_path, 9, complete=False)
    assert checkpoint.prune(FS, str(tmp_path), keep=1) == [str(tmp_path / "checkpoint_00000003")]
    left = [(s, done) for s, _, done in checkpoint.list_checkpoints(FS, str(tmp_path))]
    assert left == [(6, True), (9, False)]
    assert checkpoint.latest_complete(FS, str(tmp_path))[0] == 6
    assert checkpoint.prune(FS, str(tmp_path), keep=1) == []


def test_prune_without_a_complete_checkpoint_deletes_nothing(tmp_path):
    """A first save killed before its marker: pruning has no newest checkpoint to measure against, so it waits."""
    make(tmp_path, 3, complete=False)
    assert checkpoint.prune(FS, str(tmp_path), keep=1) == []
    assert [s for s, _, _ in checkpoint.list_checkpoints(FS, str(tmp_path))] == [3]


def test_a_run_whose_model_path_is_gone_is_checked_against_its_checkpoints_model_config(tiny_spec, tmp_path):
    """A full fine-tune resumes from its checkpoint alone: the driver's checks read the model config saved with
    the newest complete checkpoint when model.path no longer exists."""
    import json

    from trainlift.errors import UsageError
    from trainlift.train.run import checkpoint, preflight

    spec = tiny_spec(f"model.path={tmp_path / 'gone'}", "data.seq_len=64")
    saved = Path(spec.run_uri) / checkpoint.dir_name(4)
    saved.mkdir(parents=True)
    (saved / checkpoint.MODEL_CONFIG).write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 32}))
    (saved / checkpoint.MARKER).write_text("{}")
    with pytest.raises(UsageError, match=r"data.seq_len: 64 is above the 32 positions of the model stored in run "):
        preflight.check(spec)
