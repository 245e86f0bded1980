"""A run remembers what it learns from: a rerun or resume with another model, data, batch, optimizer, schedule or
adapter is refused in one line naming the changed fields; steps, cadences, trackers and workers may change.

Ray is never started: `ensure_ray` is replaced by a function that raises `RayWouldStart`, so a test sees whether
the run would have gone on to train."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from trainlift.config.job import load_job_spec
from trainlift.errors import UsageError
from trainlift.train import launch
from trainlift.train.data import source as datasource
from trainlift.train.run import spec_record

ROOT = Path(__file__).resolve().parents[2]


class RayWouldStart(Exception):
    pass


@pytest.fixture
def no_ray(monkeypatch):
    def ensure_ray(*args, **kwargs):
        raise RayWouldStart

    monkeypatch.setattr(launch, "ensure_ray", ensure_ray)


def spec(tmp_path: Path, *overrides: str):
    return load_job_spec(ROOT / "examples" / "tiny-local.yaml",
                         [f"run.storage={tmp_path / 'runs'}", "run.name=remembered",
                          f"model.path={tmp_path / 'model'}", *overrides])


def finished_run(tmp_path: Path, *overrides: str):
    """A run that finished its 20 steps with the spec `overrides` give, as a driver leaves it."""
    job = launch.preflight.check(spec(tmp_path, "train.steps=20", *overrides))
    fields = spec_record.training_fields(job, datasource.fingerprint(datasource.resolve(job.data.train)))
    spec_record.write(job, fields)
    Path(job.run_uri, "summary.json").write_text(json.dumps({"finished": True, "steps": 20, "run": job.run_uri,
                                                               "name": job.run.name}))
    return job


def test_a_finished_run_asked_to_train_on_other_data_and_lr_is_refused_naming_both(tmp_path, no_ray):
    finished_run(tmp_path)
    other = tmp_path / "other.jsonl"
    other.write_text('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n')
    with pytest.raises(UsageError) as caught:
        launch.run_training(spec(tmp_path, "train.steps=20", f"data.train={other}", "train.lr=0.001"))
    assert caught.value.message == ("run remembered was started with another spec: data.train (its rows changed); "
                                    "train.lr 0.003 → 0.001")
    assert "--allow-spec-change" in caught.value.hint and "another run.name" in caught.value.hint


def test_more_steps_other_cadences_and_workers_train_on(tmp_path, no_ray):
    finished_run(tmp_path)
    with pytest.raises(RayWouldStart):
        launch.run_training(spec(tmp_path, "train.steps=40", "train.eval_every=5", "checkpoint.every_steps=7",
                                 "scaling.workers=1", "run.trackers=[]"))
    assert launch.run_training(spec(tmp_path, "train.steps=20", "train.eval_every=5"))["already_finished"]


def test_the_same_rows_at_another_path_are_the_same_data(tmp_path, no_ray):
    job = finished_run(tmp_path)
    moved = tmp_path / "moved" / Path(job.data.train).name
    moved.parent.mkdir()
    shutil.copy(job.data.train, moved)
    assert launch.run_training(spec(tmp_path, "train.steps=20", f"data.train={moved}"))["already_finished"]


def test_allow_spec_change_goes_on_says_so_and_records_the_new_spec(tmp_path, no_ray):
    job = finished_run(tmp_path)
    notes = []
    with pytest.raises(RayWouldStart):
        launch.run_training(spec(tmp_path, "train.steps=40", "model.lora.r=4"), allow_spec_change=True,
                            on_update=lambda row: notes.append(row.get("text")) if row["event"] == "note" else None)
    assert notes == ["run remembered goes on with a changed spec: model.lora.dropout unset → 0.0; model.lora.r "
                     'unset → 4; model.lora.target_modules unset → "all-linear"']
    assert spec_record.read(job)["model.lora.r"] == 4
    with pytest.raises(RayWouldStart):  # the new spec is now the run's: the same again needs no flag
        launch.run_training(spec(tmp_path, "train.steps=40", "model.lora.r=4"))


def test_a_run_without_a_record_is_not_refused_and_gets_one(tmp_path, no_ray):
    job = launch.preflight.check(spec(tmp_path))
    Path(job.run_uri).mkdir(parents=True, exist_ok=True)
    Path(job.run_uri, "metrics.jsonl").write_text('{"event": "start", "step": 0}\n')
    with pytest.raises(RayWouldStart):
        launch.run_training(spec(tmp_path))
    assert spec_record.read(job)["train.lr"] == job.train.lr


def test_what_is_recorded_leaves_out_what_may_change():
    job = load_job_spec(ROOT / "examples" / "tiny-local.yaml", [])
    fields = spec_record.training_fields(job, "abc")
    assert fields["data.train"] == "sha256:abc"
    assert {"train.lr", "train.min_lr_ratio", "train.weight_decay", "train.seed", "data.seq_len",
            "model.config.hidden_size", "train.warmup_steps"} <= set(fields)
    assert fields["model.path"] in (spec_record.TO_BUILD, spec_record.local_identity(job.model.path))
    assert not [f for f in fields if f.split(".")[0] in ("run", "scaling", "parallel", "checkpoint", "export",
                                                          "runtime")]
    assert not {"train.steps", "train.eval_every", "data.eval", "data.eval_examples", "train.micro_batch_size",
                "train.grad_accum"} & set(fields)


def test_a_start_that_never_trained_is_rerun_with_the_spec_it_is_given(tmp_path, no_ray):
    """A first start that failed before its first checkpoint (bad rows, then fixed) has nothing to mix: the rerun
    goes on and its spec becomes the run's."""
    job = launch.preflight.check(spec(tmp_path))
    spec_record.write(job, {**spec_record.training_fields(job, "rows-before-the-fix"), "train.lr": 0.5})
    with pytest.raises(RayWouldStart):
        launch.run_training(spec(tmp_path))
    assert spec_record.read(job)["train.lr"] == job.train.lr


def test_a_local_model_is_known_by_what_it_holds_not_where_it_lies(tmp_path):
    """A submitted job's working directory is unpacked at another path on every submission."""
    first, second = tmp_path / "session-1" / "model", tmp_path / "session-2" / "model"
    for model in (first, second):
        model.mkdir(parents=True)
        (model / "config.json").write_text('{"model_type": "qwen2", "hidden_size": 64}')
        (model / "model.safetensors").write_bytes(b"\0" * 1024)
    assert spec_record.local_identity(str(first)) == spec_record.local_identity(str(second))
    (second / "config.json").write_text('{"model_type": "qwen2", "hidden_size": 128}')
    changes = spec_record.changed_fields({"model.path": spec_record.local_identity(str(first))},
                                         {"model.path": spec_record.local_identity(str(second))})
    assert changes == ["model.path (what it holds changed)"]
    assert spec_record.local_identity("Qwen/Qwen2.5-1.5B") == "Qwen/Qwen2.5-1.5B"


def test_a_local_model_deleted_after_its_checkpoint_is_not_compared_and_stays_recorded(tmp_path, no_ray):
    """A full fine-tune resumes from its checkpoint alone, so model.path may be gone by the rerun."""
    model = tmp_path / "base"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    job = launch.preflight.check(spec(tmp_path))
    fields = {**spec_record.training_fields(job, "rows"), "model.path": spec_record.local_identity(str(model))}
    spec_record.write(job, fields)
    shutil.rmtree(model)
    now = {**fields, "model.path": spec_record.local_identity(str(model))}
    assert now["model.path"] == spec_record.GONE and spec_record.changed_fields(fields, now) == []
    spec_record.write(job, now)
    assert spec_record.read(job)["model.path"] == fields["model.path"]


def test_a_model_built_from_model_config_is_recorded_and_another_model_there_is_refused(tmp_path, no_ray):
    """The DPO example's old advice: the same run, model.path pointed at the SFT export, model.config kept. The
    record holds what the built model is, so the other model is refused instead of silently resuming."""
    with pytest.raises(RayWouldStart):
        launch.run_training(spec(tmp_path, "train.steps=20"))
    job = spec(tmp_path)
    assert spec_record.read(job)["model.path"] == spec_record.local_identity(str(tmp_path / "model"))
    Path(job.run_uri, "summary.json").write_text(json.dumps({"finished": True, "steps": 20}))
    export = tmp_path / "export"
    shutil.copytree(tmp_path / "model", export)
    weights = export / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\1" * 8)  # fine-tuned: the same names and sizes
    with pytest.raises(UsageError) as caught:
        launch.run_training(spec(tmp_path, "train.steps=40", f"model.path={export}"))
    assert caught.value.message == "run remembered was started with another spec: model.path (what it holds changed)"
    with pytest.raises(RayWouldStart):  # the model it was built with trains on
        launch.run_training(spec(tmp_path, "train.steps=40"))


def test_large_weight_files_are_known_by_blocks_spread_over_them(tmp_path, monkeypatch):
    """A base model and its fine-tuned export have the same file names and sizes."""
    monkeypatch.setattr(spec_record, "SMALL_FILE_BYTES", 1024)
    base, tuned = tmp_path / "base", tmp_path / "tuned"
    for model in (base, tuned):
        model.mkdir()
        (model / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    middle = bytearray((tuned / "model.safetensors").read_bytes())
    middle[len(middle) // 2] ^= 0xFF
    (tuned / "model.safetensors").write_bytes(bytes(middle))
    assert spec_record.local_identity(str(base)) != spec_record.local_identity(str(tuned))
    assert spec_record.local_identity(str(base)).startswith("directory sampled-sha256:")


def test_an_identity_recorded_before_sampled_weights_is_not_compared():
    """A run recorded by an older trainlift resumes: its model identity was taken another way."""
    legacy = {"model.path": "directory sha256:" + "0" * 64, "train.lr": 0.1}
    now = {"model.path": "directory sampled-sha256:" + "1" * 64, "train.lr": 0.1}
    assert spec_record.changed_fields(legacy, now) == []
    assert spec_record.changed_fields({**legacy, "model.path": "directory sampled-sha256:" + "2" * 64}, now) == [
        "model.path (what it holds changed)"]


def test_a_record_from_before_model_path_was_recorded_with_model_config_still_resumes(tmp_path, no_ray):
    job = finished_run(tmp_path)
    fields = spec_record.read(job)
    spec_record.write(job, {k: v for k, v in fields.items() if k != "model.path"})
    with pytest.raises(RayWouldStart):
        launch.run_training(spec(tmp_path, "train.steps=40"))
