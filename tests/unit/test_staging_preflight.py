"""The driver's staging check: two checkpoints of the run must fit the staging directory's free space when every
worker stages on this machine. The model's size comes from its config (no weights are read)."""

from __future__ import annotations

import pytest

from trainlift.config.job import validate_job_spec
from trainlift.errors import UsageError
from trainlift.estimate.memory import checkpoint_bytes
from trainlift.estimate.shape import shape_of
from trainlift.train.run import preflight

CONFIG = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "tie_word_embeddings": False}


def spec(**checkpoint):
    return validate_job_spec({"model": {"config": CONFIG, "tokenizer": "t"}, "data": {"train": "t.jsonl"},
                              "checkpoint": checkpoint})


def test_two_checkpoints_that_do_not_fit_are_refused_in_one_line():
    need = 2 * checkpoint_bytes(shape_of(preflight.model_config(spec())))
    preflight.check_staging_space(spec(), free_bytes=int(need) + 1)
    with pytest.raises(UsageError) as raised:
        preflight.check_staging_space(spec(), free_bytes=int(need) - 1)
    line = raised.value.one_line()
    assert "checkpoint staging: two checkpoints of this model take" in line and "TRAINLIFT_STAGING_DIR" in line
    assert "\n" not in line


def test_a_checkpoint_holds_twelve_bytes_per_trainable_parameter():
    shape = shape_of(preflight.model_config(spec()))
    assert checkpoint_bytes(shape) == 12 * shape.params  # fp32 weight + two fp32 AdamW moments
    assert checkpoint_bytes(shape, lora_params=1000) == 12_000  # LoRA saves its adapters only


def test_a_run_without_checkpoints_needs_no_staging():
    preflight.check_staging_space(spec(every_steps=0), free_bytes=0)
