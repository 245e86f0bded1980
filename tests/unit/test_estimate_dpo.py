"""`trainlift estimate` for DPO: a step costs what an SFT step on the same rows costs, and the run adds its reference
pass once: one forward (2 FLOPs per parameter a token goes through, plus the attention's forward) over as many
tokens as the steps train on, every worker scoring its share; no second model is held."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainlift import catalog
from trainlift.config.job import apply_overrides, validate_job_spec
from trainlift.estimate.plan import Target, plan
from trainlift.estimate.shape import shape_of
from trainlift.ops.model_config import read_config_file

REPO = Path(__file__).resolve().parents[2]
SHAPE = shape_of(read_config_file(REPO / "examples" / "model-configs" / "llama-3.1-8b.json"))
P5 = Target(catalog.lookup("p5.48xlarge"), 1, usd_per_hour=55.0, price_source="test")


def estimate(*overrides: str):
    raw = {"model": {"config": {"model_type": "llama"}, "tokenizer": "t", "activation_checkpointing": "selective"},
           "data": {"train": "t.jsonl", "seq_len": 4096}, "train": {"micro_batch_size": 2, "steps": 200},
           "scaling": {"workers": "auto"}}
    return plan(validate_job_spec(apply_overrides(raw, list(overrides))), SHAPE, P5)


@pytest.mark.parametrize("lora", [(), ("model.lora.r=16",)])
def test_dpo_adds_one_forward_over_the_trained_tokens_and_no_memory(lora):
    sft = estimate(*lora)
    dpo = estimate("train.objective=dpo", "data.format=preference", *lora)
    assert sft.reference_s is None and dpo.items == sft.items and dpo.timing == sft.timing
    tokens = 8 * 2 * 4096 * 200  # workers x micro-batch x seq_len x steps
    lora_params = dpo.workload.lora_params
    forward = 2 * (SHAPE.active_decoder_params + SHAPE.vocab * SHAPE.hidden + lora_params) \
        + 4 * SHAPE.layers * SHAPE.heads * SHAPE.head_dim * 4096
    assert dpo.reference_s == pytest.approx(tokens * forward / (989e12 * dpo.fabric.hfu * 8), rel=1e-6)
    assert dpo.hours == pytest.approx(sft.hours + dpo.reference_s / 3600)
    assert 0.2 < dpo.reference_s / (sft.hours * 3600) < 0.4  # a forward is about a third of a step's compute
    assert dpo.to_dict()["reference_pass_s"] == round(dpo.reference_s, 1)
