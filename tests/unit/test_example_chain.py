"""The DPO and LoRA examples start from the SFT demo's export under their own run names (a random base learns
nothing from LoRA, and DPO on it keeps none of the demo's tasks), and say so in one line when the demo has not
been trained yet."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from trainlift.config.job import load_job_spec
from trainlift.config.spec_paths import relative_to_spec
from trainlift.errors import UsageError
from trainlift.train.run import preflight

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("example", ["tiny-local-dpo.yaml", "tiny-local-lora.yaml"])
def test_the_example_trains_the_sft_demos_export_under_its_own_run_name(example):
    demo = load_job_spec(EXAMPLES / "tiny-local.yaml")
    job = load_job_spec(EXAMPLES / example)
    assert Path(job.model.path).resolve() == Path(demo.run_uri, "final").resolve()
    assert job.model.config is None and job.run.name != demo.run.name
    assert job.run.storage == demo.run.storage


def test_dpo_keeps_the_answers_with_the_chosen_replies_nll():
    """sft_weight 0 with these pairs took the demo's exact match from 75% to 0% (examples/tiny-local-dpo.yaml)."""
    assert load_job_spec(EXAMPLES / "tiny-local-dpo.yaml").train.dpo.sft_weight > 0


def test_before_the_demo_has_trained_the_missing_export_is_named_in_one_line(tmp_path):
    shutil.copytree(EXAMPLES, tmp_path / "examples")
    job = load_job_spec(tmp_path / "examples" / "tiny-local-dpo.yaml")
    with pytest.raises(UsageError) as caught:
        preflight.model_config(job)
    assert caught.value.message == f"model.path: no model directory at {tmp_path / 'runs' / 'tiny-demo' / 'final'}"
    assert "<run.storage>/<run.name>/final" in caught.value.hint


def test_a_hub_id_stays_a_hub_id_and_a_path_that_is_no_hub_id_is_the_specs(tmp_path):
    """`owner/name` may be a hub model; `../x`, `./x` and `a/b/c` can only be paths, taken from the spec's directory
    even before they exist (so that the error names the right place)."""
    def path_of(given: str) -> str:
        return relative_to_spec({"model": {"path": given}}, tmp_path / "examples")["model"]["path"]

    assert path_of("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B" and path_of("gpt2") == "gpt2"
    for local in ("../runs/x/final", "./model", "runs/x/final"):
        assert path_of(local) == str(tmp_path / "examples" / local)
