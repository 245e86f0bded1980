"""What DPO's policy and reference passes do to the model: the reference pass of a LoRA run bypasses the adapters
without touching any parameter's `requires_grad` (peft's own `disable_adapter()` clears it, which FSDP2 never
sees restored on its sharded parameters), and the policy runs without dropout unless `train.dpo.dropout` asks."""

import pytest
import torch

from trainlift.config.job import validate_job_spec
from trainlift.train.model import lora
from trainlift.train.run.reference import without_dropout

TINY = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 97, "attention_dropout": 0.5}


def adapted(dropout: float = 0.5):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY))
    model = lora.apply(model, validate_job_spec({"model": {"path": "m", "lora": {"r": 4, "dropout": dropout}},
                                                 "data": {"train": "t.jsonl"}}).model.lora)
    for name, param in model.named_parameters():
        if ".lora_B." in name:  # trained adapters: the adapted model differs from its base
            torch.nn.init.normal_(param, std=0.5)
    return model


def test_adapters_off_gives_the_base_models_output_and_leaves_requires_grad_alone():
    model = adapted(dropout=0.0).eval()
    ids = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    with model.disable_adapter():
        base = model(input_ids=ids).logits
    with lora.adapters_off(model):
        off = model(input_ids=ids).logits
        assert {name for name, p in model.named_parameters() if p.requires_grad} == trainable
    on = model(input_ids=ids).logits
    assert torch.equal(off, base)
    assert not torch.allclose(on, base)
    assert {name for name, p in model.named_parameters() if p.requires_grad} == trainable


def test_the_dpo_policy_runs_without_dropout():
    model = adapted().train()
    ids = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    assert not torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)  # dropout is on
    without_dropout(model)
    assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)
    assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))


@pytest.mark.parametrize("section,keeps", [({}, False), ({"dropout": True}, True)])
def test_train_dpo_dropout_defaults_off(section, keeps):
    spec = validate_job_spec({"model": {"path": "m"}, "data": {"train": "t.jsonl"},
                              "train": {"objective": "dpo", "dpo": section}})
    assert spec.train.dpo.dropout is keeps
