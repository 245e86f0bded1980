"""The job spec: typed fields, unknown keys rejected, --set overrides, errors that name the field."""

from pathlib import Path

import pytest

from trainlift.config.job import JobSpec, apply_overrides, load_job_spec, validate_job_spec
from trainlift.errors import SpecError

REPO = Path(__file__).resolve().parents[2]
MINIMAL = {"model": {"path": "m"}, "data": {"train": "t.jsonl"}}


def test_minimal_spec_gets_defaults():
    spec = validate_job_spec(dict(MINIMAL))
    assert spec.scaling.workers == 2
    assert spec.run_uri == "runs/run"
    assert spec.data.format == "auto"


def test_unknown_key_names_its_path():
    with pytest.raises(SpecError, match=r"train\.stepz: unknown key"):
        validate_job_spec({**MINIMAL, "train": {"stepz": 3}})


def test_wrong_type_names_field_and_value():
    with pytest.raises(SpecError, match=r"train\.steps: .*integer.*'many'"):
        validate_job_spec({**MINIMAL, "train": {"steps": "many"}})


def test_overrides_keep_yaml_types():
    raw = apply_overrides({"model": {"path": "m"}}, ["train.steps=7", "train.lr=1e-4", "scaling.workers=auto"])
    spec = validate_job_spec({**raw, "data": {"train": "t"}})
    assert spec.train.steps == 7 and spec.train.lr == pytest.approx(1e-4) and spec.scaling.workers == "auto"


def test_workers_as_a_range_is_elastic_and_checked():
    spec = validate_job_spec(apply_overrides(dict(MINIMAL), ["scaling.workers=[2, 4]"]))
    assert spec.scaling.elastic and (spec.scaling.min_workers, spec.scaling.max_workers) == (2, 4)
    assert not validate_job_spec({**MINIMAL, "scaling": {"workers": [3, 3]}}).scaling.elastic
    with pytest.raises(SpecError, match=r"scaling\.workers: a range \[min, max\] needs 1 <= min <= max \(got \[4, 2\]\)"):
        validate_job_spec({**MINIMAL, "scaling": {"workers": [4, 2]}})


def test_fewer_elastic_workers_take_more_micro_batches_to_keep_the_global_batch():
    from trainlift.train.recipe import micro_batches_per_step

    elastic = validate_job_spec({**MINIMAL, "scaling": {"workers": [1, 4]}, "train": {"grad_accum": 2}})
    assert [micro_batches_per_step(elastic, world) for world in (4, 2, 1, 3)] == [2, 4, 8, 3]
    fixed = validate_job_spec({**MINIMAL, "train": {"grad_accum": 2}})
    assert micro_batches_per_step(fixed, 1) == 2  # a fixed size keeps grad_accum, as given


def test_override_without_equals_is_a_spec_error():
    with pytest.raises(SpecError, match="KEY=VALUE"):
        apply_overrides({}, ["train.steps"])


def test_model_needs_a_source():
    with pytest.raises(SpecError, match="model: set model.path"):
        validate_job_spec({"model": {}, "data": {"train": "t"}})


def test_run_name_must_be_a_safe_directory_name():
    with pytest.raises(SpecError, match=r"run\.name"):
        validate_job_spec({**MINIMAL, "run": {"name": "../escape"}})


def test_yaml_syntax_error_names_the_line(tmp_path):
    bad = tmp_path / "job.yaml"
    bad.write_text("model:\n  path: m\n data: [\n")
    with pytest.raises(SpecError, match=r"job\.yaml:\d+: not valid YAML"):
        load_job_spec(bad)


@pytest.mark.parametrize("name", ["tiny-local.yaml", "qwen2.5-1.5b-eks.yaml"])
def test_shipped_examples_validate(name):
    spec = load_job_spec(REPO / "examples" / name)
    assert isinstance(spec, JobSpec)


def test_reference_job_is_the_published_shape():
    """Qwen2.5-1.5B, 8 GPU workers, bf16, seq 2048 (the reference sample's job)."""
    spec = load_job_spec(REPO / "examples" / "qwen2.5-1.5b-eks.yaml")
    assert spec.model.path == "Qwen/Qwen2.5-1.5B"
    assert (spec.scaling.workers, spec.scaling.device, spec.model.dtype, spec.data.seq_len) == (8, "cuda", "bf16", 2048)
    assert spec.run.storage.startswith("s3://")


def test_relative_paths_in_a_spec_file_are_relative_to_it_and_set_values_to_the_current_directory(tmp_path):
    from trainlift.config.job import load_job_spec

    project = tmp_path / "project"
    (project / "tok").mkdir(parents=True)
    (project / "job.yaml").write_text(
        "model: {path: Qwen/Qwen2.5-1.5B, tokenizer: tok}\n"
        "data: {train: data/train.jsonl, eval: s3://bucket/eval.jsonl}\nrun: {storage: ../runs}\n")
    spec = load_job_spec(project / "job.yaml", ["data.eval=local/eval.jsonl"])
    assert spec.model.path == "Qwen/Qwen2.5-1.5B"  # not a directory there: a hub id
    assert spec.model.tokenizer == str(project / "tok")
    assert spec.data.train == str(project / "data" / "train.jsonl")
    assert spec.data.eval == "local/eval.jsonl"  # from --set: relative to where the command runs
    assert spec.run.storage == str(project / ".." / "runs")

    (project / "build.yaml").write_text("model: {path: out/model, tokenizer: tok, config: {model_type: qwen2}}\n"
                                        "data: {train: /abs/train.jsonl}\n")
    built = load_job_spec(project / "build.yaml")
    assert built.model.path == str(project / "out" / "model") and built.data.train == "/abs/train.jsonl"


def test_a_model_built_from_its_config_is_not_saved_to_s3():
    with pytest.raises(SpecError, match=r"model.path: s3://b/m cannot take a model built from model.config"):
        validate_job_spec({"model": {"path": "s3://b/m", "config": {"model_type": "llama"}},
                           "data": {"train": "t.jsonl"}})


def test_a_set_typo_is_blamed_on_the_set_with_the_key_it_meant():
    with pytest.raises(SpecError) as caught:
        load_job_spec(REPO / "examples" / "tiny-local.yaml", ["train.stpes=3"])
    assert caught.value.message == "--set train.stpes=3: train.stpes: unknown key (did you mean train.steps?)"
    with pytest.raises(SpecError) as caught:
        load_job_spec(REPO / "examples" / "tiny-local.yaml", ["trian.steps=3"])
    assert caught.value.message == "--set trian.steps=3: trian: unknown key (did you mean train?)"
    with pytest.raises(SpecError) as caught:
        load_job_spec(REPO / "examples" / "tiny-local.yaml", ["model.lora.rr=3"])
    assert caught.value.message.endswith("model.lora.rr: unknown key (did you mean model.lora.r?)")
