"""trainlift writes a local run directory's files without following links: a spec.json, driver record, driver lock,
metrics file, summary, driver log or checkpoint file that is a link to another file is refused in one line naming
it, by `trainlift train` before anything of the run is written, and by each writer itself; the file it points at
is left as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from trainlift import rundir, run_lease
from trainlift.errors import UsageError
from trainlift.train.run import checkpoint, metrics, spec_record

PLANTED = ["spec.json", "driver.json", ".driver.lock", "metrics.jsonl", "summary.json", "driver.log",
           "checkpoint_00000003/__0_0.distcp"]
VICTIM_TEXT = "the user's own file\n"


def plant(run_dir: Path, name: str, victim: Path) -> Path:
    """`run_dir/name` as a link to `victim`, a file of the user's outside the run."""
    victim.write_text(VICTIM_TEXT)
    link = run_dir / name
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(victim)
    return link


def assert_refused(error: BaseException, link: Path) -> None:
    assert isinstance(error, UsageError), error
    line = error.one_line()
    assert line.startswith(f"{link} is a symbolic link (to ") and "follows no link" in line and "\n" not in line


@pytest.mark.parametrize("name", PLANTED)
def test_trainlift_train_refuses_a_run_directory_holding_a_link(tmp_path, tiny_spec, name):
    import yaml
    from typer.testing import CliRunner

    from trainlift.cli import app

    spec = tiny_spec()
    run_dir, victim = Path(spec.run_uri), tmp_path / "victim.txt"
    run_dir.mkdir(parents=True)
    link = plant(run_dir, name, victim)
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    result = CliRunner().invoke(app, ["train", str(spec_file), "--address", "http://127.0.0.1:9"])
    assert_refused(result.exception, link)
    assert victim.read_text() == VICTIM_TEXT
    assert sorted(p.name for p in run_dir.iterdir()) == [name.split("/")[0]]  # nothing else written


def test_the_spec_record_is_not_written_through_a_link(tmp_path, tiny_spec):
    spec = tiny_spec()
    link = plant(Path(spec.run_uri), spec_record.RECORD, tmp_path / "victim.txt")
    with pytest.raises(UsageError) as refused:
        spec_record.write(spec, {"model.path": "x"})
    assert_refused(refused.value, link)
    assert (tmp_path / "victim.txt").read_text() == VICTIM_TEXT


@pytest.mark.parametrize("name", [rundir.DRIVER_RECORD, run_lease.LOCK_FILE])
def test_the_driver_record_and_its_lock_are_not_written_through_a_link(tmp_path, name):
    link = plant(tmp_path / "run", name, tmp_path / "victim.txt")
    with pytest.raises(UsageError) as refused:
        run_lease.claim(str(tmp_path / "run"), {"pid": 1}, lambda holder: False)
    assert_refused(refused.value, link)
    assert (tmp_path / "victim.txt").read_text() == VICTIM_TEXT


def test_metrics_are_not_appended_through_a_link(tmp_path):
    link = plant(tmp_path / "run", "metrics.jsonl", tmp_path / "victim.txt")
    with pytest.raises(UsageError) as refused:
        metrics.JsonlSink(pafs.LocalFileSystem(), str(link))
    assert_refused(refused.value, link)
    assert (tmp_path / "victim.txt").read_text() == VICTIM_TEXT


def test_a_summary_is_not_written_through_a_link(tmp_path):
    link = plant(tmp_path / "run", "summary.json", tmp_path / "victim.txt")
    with pytest.raises(UsageError) as refused:
        rundir.write_file(pafs.LocalFileSystem(), str(link), json.dumps({"finished": True}).encode())
    assert_refused(refused.value, link)
    assert (tmp_path / "victim.txt").read_text() == VICTIM_TEXT


@pytest.mark.parametrize("name", [checkpoint.MARKER, "__0_0.distcp"])
def test_a_checkpoint_holding_a_link_is_not_marked_complete(tmp_path, name):
    path = tmp_path / "run" / "checkpoint_00000003"
    path.mkdir(parents=True)
    for present in (".metadata", checkpoint.TRAINER_STATE, "__0_0.distcp", "rng_rank0.pt"):
        if present != name:
            (path / present).write_text("x")
    link = plant(path, name, tmp_path / "victim.txt")
    with pytest.raises(UsageError) as refused:
        checkpoint.mark_complete(pafs.LocalFileSystem(), str(path), 3, 1)
    assert_refused(refused.value, link)
    assert (tmp_path / "victim.txt").read_text() == VICTIM_TEXT
