"""The driver's staging check: two checkpoints of a full fine-tune must fit the staging directory's free space when
every worker stages on this machine. The model's size comes from its safetensors headers (no weights read)."""

from __future__ import annotations

import pytest

from trainlift.config.job import validate_job_spec
from trainlift.errors import UsageError
from trainlift.train.run import preflight


def spec(model_dir, **sections):
    return validate_job_spec({"model": {"path": str(model_dir), **sections.pop("model", {})},
                              "data": {"train": "t.jsonl"}, **sections})


def test_two_checkpoints_that_do_not_fit_are_refused_in_one_line(tiny_assets):
    from transformers import AutoModelForCausalLM

    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_assets / "model").parameters())
    assert preflight.stored_parameters(str(tiny_assets / "model")) == params
    need = 2 * 12 * params  # fp32 weight + two fp32 AdamW moments, twice
    preflight.check_staging_space(spec(tiny_assets / "model"), free_bytes=need)
    with pytest.raises(UsageError) as raised:
        preflight.check_staging_space(spec(tiny_assets / "model"), free_bytes=need - 1)
    line = raised.value.one_line()
    assert "checkpoint staging: two checkpoints of this model take" in line and "TRAINLIFT_STAGING_DIR" in line
    assert "\n" not in line


def test_runs_whose_checkpoints_are_small_or_absent_are_not_checked(tiny_assets):
    preflight.check_staging_space(spec(tiny_assets / "model", checkpoint={"every_steps": 0}), free_bytes=0)
    preflight.check_staging_space(spec(tiny_assets / "model", model={"lora": {"r": 4}}), free_bytes=0)
    preflight.check_staging_space(spec("Qwen/Qwen2.5-1.5B"), free_bytes=0)  # a hub model: not on this disk
