"""Loading a checkpoint runs no code and changes nothing outside the load, whatever the bytes of its `.metadata`:
each crafted file of tests/fixtures/hostile/checkpoint_metadata (BUILD on a class and on a function, DCP's classes
called with what other calls made, a command, truncated, a pickle after the pickle) and an oversized one are
refused in one line, by `trainlift train` on the driver before any worker starts and by the workers' reader, with
nothing written outside the run and no class or function changed. The genuine file of that folder, and
checkpoints trainlift writes now, read as torch's own unpickler reads them."""

from __future__ import annotations

import os
import pathlib
import pickle
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch
import torch.serialization
from torch.distributed.fsdp import fully_shard

from trainlift.errors import UsageError
from trainlift.train.run import checkpoint, dcp_metadata, safe_load

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "hostile" / "checkpoint_metadata"
CRAFTED = sorted(p.stem for p in CORPUS.glob("*.metadata") if p.stem != "genuine") + ["oversized"]
PLANTED = "/outside/planted"


def tiny_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2, bias=False))
    model[0].weight.requires_grad_(False)
    fully_shard(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def save(directory: Path) -> None:
    model, optimizer, scheduler = tiny_model()
    model(torch.randn(3, 4)).square().sum().backward()
    optimizer.step()
    checkpoint.write_shard(str(directory), model, optimizer, scheduler, 3, 7, rank=0, world=1)
    (directory / "COMPLETE").write_text("")


def plant(directory: Path, name: str) -> None:
    """The crafted `.metadata` `name` in place of the checkpoint's own; `oversized` is a sparse file one byte over
    the limit."""
    target = directory / ".metadata"
    if name == "oversized":
        target.write_bytes((CORPUS / "genuine.metadata").read_bytes())
        os.truncate(target, dcp_metadata.MAX_BYTES + 1)
    else:
        target.write_bytes((CORPUS / f"{name}.metadata").read_bytes())


def unchanged_globals() -> None:
    assert "_str" not in vars(pathlib.PosixPath) and str(pathlib.Path("/runs/a")) == "/runs/a"
    assert all(isinstance(v, torch.layout) for v in getattr(torch.serialization._get_layout, "cache", {}).values())
    assert not Path(PLANTED).exists()


def files_under(root: Path, but: Path) -> set[Path]:
    return {p for p in root.rglob("*") if but not in p.parents and p != but}


def same_metadata(ours, torchs) -> bool:
    """Equal field by field; DCP's unpickler gives checkpoint_id as the Path it pickled, this reader as its text."""
    torchs.storage_meta.checkpoint_id = str(torchs.storage_meta.checkpoint_id)
    return ours == torchs


def test_the_genuine_metadata_reads_as_torch_reads_it():
    data = (CORPUS / "genuine.metadata").read_bytes()
    assert same_metadata(dcp_metadata.parse(data), pickle.loads(data))


def test_a_checkpoint_trainlift_writes_reads_as_torch_reads_it(tmp_path, single_process_group):
    save(tmp_path / "checkpoint_00000003")
    data = (tmp_path / "checkpoint_00000003" / ".metadata").read_bytes()
    assert same_metadata(dcp_metadata.parse(data), pickle.loads(data))


@pytest.mark.parametrize("name", CRAFTED)
def test_trainlift_train_refuses_each_crafted_metadata_before_any_worker_starts(tmp_path, tiny_spec,
                                                                               single_process_group, name):
    """The refusal is `trainlift train`'s own one line (exit 2), on the driver: the address it is given is no Ray."""
    import yaml
    from typer.testing import CliRunner

    from trainlift.cli import app

    spec = tiny_spec()
    run_dir = Path(spec.run_uri)
    directory = run_dir / "checkpoint_00000003"
    save(directory)
    plant(directory, name)
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    before = files_under(tmp_path, but=run_dir)
    result = CliRunner().invoke(app, ["train", str(spec_file), "--address", "http://127.0.0.1:9"])
    assert isinstance(result.exception, UsageError), result.output
    line = result.exception.one_line()
    assert line.startswith(f"{directory} is not a checkpoint trainlift wrote (.metadata: ") and "\n" not in line
    assert not (run_dir / "driver.json").exists()
    assert files_under(tmp_path, but=run_dir) == before
    unchanged_globals()


@pytest.mark.parametrize("name", CRAFTED)
def test_the_workers_reader_refuses_each_crafted_metadata(tmp_path, single_process_group, name):
    directory = tmp_path / "checkpoint_00000003"
    save(directory)
    plant(directory, name)
    with pytest.raises(UsageError, match=r"is not a checkpoint trainlift wrote \(\.metadata: "):
        checkpoint.load(pafs.LocalFileSystem(), str(directory), *tiny_model(), rank=0)
    unchanged_globals()


def test_a_stand_in_class_cannot_be_changed():
    stand_in = dcp_metadata.STAND_INS[("pathlib", "PosixPath")]
    with pytest.raises(pickle.UnpicklingError, match="it sets pathlib.PosixPath._str"):
        stand_in._str = PLANTED
    with pytest.raises(UsageError, match=r"it sets attributes of torch\.float32"):
        safe_load.parse_metadata(b"\x80\x04ctorch\nfloat32\n}b.", "checkpoint")
