"""Whoever can write a run's storage cannot run code on the workers or write outside trainlift's directories:
checkpoints trainlift wrote (sync and async, with optimizer state and frozen weights left out) load, a checkpoint
whose `.metadata` or stored values would run code when unpickled is refused before that code runs, and a data
cache manifest or a model's index naming paths outside their folder is refused before anything is written.
Checkpoints are real DCP saves of an FSDP2 model; S3 is moto over HTTP on loopback."""

from __future__ import annotations

import json
import os
import pickle
import runpy
import shlex
import tempfile
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard

from trainlift.errors import UsageError
from trainlift.train.data import cache as datacache
from trainlift.train.model import fetch
from trainlift.train.run import checkpoint, saving

h = runpy.run_path(str(Path(__file__).parents[1] / "integration" / "conftest_aws.py"))["load"]()  # moto, shared
FS = pafs.LocalFileSystem()
BUCKET = "trainlift-untrusted"


class RunsCommand:
    """Unpickled, it runs `command` in a shell."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def touch(marker: Path) -> str:
    return f"touch {shlex.quote(str(marker))}"


def reaching_through_an_allowed_module(command: str) -> bytes:
    """A pickle calling `torch.serialization.os.system(command)`, named as module `torch`, attribute path
    `serialization.os.system`: how a restriction by module name alone is walked around."""
    def text(s: str) -> bytes:
        return b"\x8c" + bytes([len(s.encode())]) + s.encode()

    return b"\x80\x04" + text("torch") + text("serialization.os.system") + b"\x93" + text(command) + b"\x85R."


def tiny_model(seed: int, lr: float = 1e-3):
    """A sharded model whose first weight is frozen (as a LoRA fine-tune's base weights), its optimizer and
    scheduler."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2, bias=False))
    model[0].weight.requires_grad_(False)
    fully_shard(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def trained_model():
    model, optimizer, scheduler = tiny_model(seed=0)
    model(torch.randn(3, 4)).square().sum().backward()
    optimizer.step()
    return model, optimizer, scheduler


def save(directory: Path, mode: str):
    """A checkpoint of a trained model in `directory`, written as trainlift's saver writes it in `mode`."""
    model, optimizer, scheduler = trained_model()
    if mode == "sync":
        checkpoint.write_shard(str(directory), model, optimizer, scheduler, 3, 7, rank=0, world=1)
    else:
        written, _ = saving.start_write(str(directory), model, optimizer, None, torch.device("cpu"))
        written.result()
        checkpoint.write_extras(str(directory), model, scheduler, 3, 7, rank=0, world=1)
    return model, optimizer


def load_fresh(directory: Path):
    model, optimizer, scheduler = tiny_model(seed=1, lr=5e-4)
    return checkpoint.load(FS, str(directory), model, optimizer, scheduler, rank=0), model, optimizer


def moments(optimizer) -> list[list[float]]:
    """AdamW's moments of each trainable parameter, whole."""
    return [optimizer.state[p][k].full_tensor().flatten().tolist()
            for p in optimizer.param_groups[0]["params"] for k in ("exp_avg", "exp_avg_sq")]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_checkpoints_trainlift_writes_load_whole(tmp_path, single_process_group, mode):
    saved, saved_optimizer = save(tmp_path / "checkpoint_00000003", mode)
    (step, cursor), model, optimizer = load_fresh(tmp_path / "checkpoint_00000003")
    assert (step, cursor) == (3, 7)
    assert torch.equal(model[1].weight.full_tensor(), saved[1].weight.full_tensor())
    assert torch.equal(model[0].bias.full_tensor(), saved[0].bias.full_tensor())
    assert not torch.equal(model[0].weight.full_tensor(), saved[0].weight.full_tensor())  # frozen: not checkpointed
    assert optimizer.param_groups[0]["lr"] == 1e-3  # a stored non-tensor value
    assert moments(optimizer) == moments(saved_optimizer)


@pytest.mark.parametrize("payload", ["reduce", "dotted name"])
def test_a_metadata_that_runs_code_is_refused_before_it_runs(tmp_path, single_process_group, payload):
    directory, marker = tmp_path / "checkpoint_00000003", tmp_path / "ran"
    save(directory, "sync")
    crafted = pickle.dumps(RunsCommand(touch(marker))) if payload == "reduce" else \
        reaching_through_an_allowed_module(touch(marker))
    (directory / ".metadata").write_bytes(crafted)
    with pytest.raises(UsageError) as refused:
        load_fresh(directory)
    message = refused.value.one_line()
    assert message.startswith(f"{directory} is not a checkpoint trainlift wrote (.metadata: it refers to ")
    assert "\n" not in message and "delete that directory" in message
    assert not marker.exists()


def test_a_stored_value_that_runs_code_is_refused_before_it_runs(tmp_path, single_process_group):
    """The optimizer's hyperparameters are pickled into the shards: a value there is read as data only."""
    directory, marker = tmp_path / "checkpoint_00000003", tmp_path / "ran"
    model, optimizer, scheduler = trained_model()
    model_sd, optim_sd = checkpoint.trainable_state(model, optimizer)
    optim_sd["param_groups"][0]["lr"] = RunsCommand(touch(marker))
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(directory))
    checkpoint.write_extras(str(directory), model, scheduler, 3, 7, rank=0, world=1)
    with pytest.raises(UsageError, match=rf"^{directory} is not a checkpoint trainlift wrote \(optim\.param_groups\.0"
                                         r"\.lr: it refers to posix\.system\)"):
        load_fresh(directory)
    assert not marker.exists()


def test_a_metadata_pointing_outside_the_checkpoint_is_refused(tmp_path, single_process_group):
    directory = tmp_path / "checkpoint_00000003"
    save(directory, "sync")
    metadata = pickle.loads((directory / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../../elsewhere/__0_0.distcp"
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UsageError, match=r"points at '\.\./\.\./elsewhere/__0_0\.distcp', not at shard files"):
        load_fresh(directory)


@pytest.fixture
def s3(monkeypatch, tmp_path):
    """moto with an empty bucket, and this user's temporary directory (where nodes keep their caches) in tmp_path."""
    import boto3

    h.use_bucket(monkeypatch, tmp_path, BUCKET)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.delenv(fetch.STAGING_ENV, raising=False)
    monkeypatch.delenv(fetch.CACHE_ENV, raising=False)
    return boto3.client("s3")


@pytest.mark.parametrize("name", ["../../planted.npy", "absolute"])
def test_a_data_cache_manifest_naming_paths_outside_the_cache_is_refused(s3, tmp_path, name):
    """A cache on S3 whose manifest's names, joined to the node's download directory, lead out of it."""
    key, outside = "0" * 32, tmp_path / "outside" / "planted.npy"
    outside.parent.mkdir()
    fs, root = datacache.root_of(f"s3://{BUCKET}/runs")
    prefix = "abcdef12/" if name.startswith("..") else "abcdef12"
    name = name if name.startswith("..") else str(outside)
    stored = os.path.normpath(f"runs/.cache/data/{key}/{prefix}{name}")  # where S3 keeps what the name points at
    s3.put_object(Bucket=BUCKET, Key=stored, Body=b"planted")
    manifest = {"version": datacache.VERSION, "key": key, "prefix": prefix, "rows": 1, "shard_rows": [1],
                "truncated": 0, "tokens": 1, "files": {name: {"bytes": 7, "sha256": "0" * 64}}}
    s3.put_object(Bucket=BUCKET, Key=f"runs/.cache/data/{key}/manifest.json", Body=json.dumps(manifest).encode())
    with pytest.raises(UsageError) as refused:
        datacache.local_copy(fs, root, key)
    assert refused.value.one_line().startswith(f"{root}/{key}/manifest.json names ")
    assert "not a data cache trainlift wrote" in refused.value.message
    assert list(tmp_path.rglob("planted*")) == []


def test_a_model_index_naming_a_path_outside_the_download_is_refused(s3, tmp_path):
    prefix = "models/tiny"
    index = {"weight_map": {"lm_head.weight": "../../planted.safetensors"}}
    for name, body in (("config.json", b"{}"), (fetch.INDEX, json.dumps(index).encode()),
                       ("planted.safetensors", b"planted")):
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{name}", Body=body)
    with pytest.raises(UsageError, match=r"names '\.\./\.\./planted\.safetensors' \(in model\.safetensors\.index\.json"
                                         r" or its listing\), which is not a file of that folder"):
        fetch.model_dir(f"s3://{BUCKET}/{prefix}")
    assert list((tmp_path / "tmp").rglob("planted*")) == []


def test_trainlift_train_refuses_a_crafted_checkpoint_before_any_worker_starts(tmp_path, tiny_spec, single_process_group):
    """The refusal is `trainlift train`'s own one line (exit 2), raised on the driver before Ray is started."""
    from typer.testing import CliRunner

    import yaml
    from trainlift.cli import app

    spec = tiny_spec()
    directory, marker = Path(spec.run_uri) / "checkpoint_00000003", tmp_path / "ran"
    save(directory, "sync")
    (directory / "COMPLETE").write_text("")
    (directory / ".metadata").write_bytes(pickle.dumps(RunsCommand(touch(marker))))
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    result = CliRunner().invoke(app, ["train", str(spec_file), "--address", "http://127.0.0.1:9"])
    assert isinstance(result.exception, UsageError), result.output
    assert result.exception.one_line().startswith(f"{directory} is not a checkpoint trainlift wrote (.metadata: it "
                                                  "refers to ")
    assert not marker.exists() and not (Path(spec.run_uri) / "driver.json").exists()
