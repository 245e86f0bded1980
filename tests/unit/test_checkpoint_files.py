"""Checkpoint bookkeeping on a real filesystem: only complete checkpoints count, pruning is safe."""

import pyarrow.fs as pafs

from trainlift.train import checkpoint

FS = pafs.LocalFileSystem()


def make(run, step, complete):
    path = run / checkpoint.dir_name(step)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"x")
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
