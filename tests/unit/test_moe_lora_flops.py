"""LoRA's FLOPs per token on a mixture of experts count the experts a token is routed to, as full fine-tuning's
count does: before, they took every expert off a count that had already left the idle ones out, and went
negative."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from trainlift.config.job import LoraSection
from trainlift.train.model import lora
from trainlift.train.model.build import step_flops

# Qwen3-MoE, 2 layers, hidden 32, 2 query heads and 1 KV head of 16, 64 experts of width 16, top-2, untied head.
QWEN3_MOE = dict(model_type="qwen3_moe", hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=96,
                 num_experts=64, num_experts_per_tok=2, tie_word_embeddings=False)


def test_lora_flops_on_a_64_expert_qwen3_moe_match_a_hand_count():
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**QWEN3_MOE))
    full = step_flops(model).base
    model = lora.apply(model, LoraSection(r=4, target_modules=["q_proj", "v_proj"]))

    # What one token goes through in a layer: q_proj 32x32 = 1,024; k_proj 16x32 = 512; v_proj 512;
    # o_proj 32x32 = 1,024; the router 64x32 = 2,048; 2 of the 64 experts, each gate_up 32x32 = 1,024 and
    # down 32x16 = 512, 2 x 1,536 = 3,072; norms q 16 + k 16 + input 32 + post-attention 32 = 96.
    per_layer = 1024 + 512 + 512 + 1024 + 2048 + 2 * 1536 + 96
    assert per_layer == 8288
    # Two layers, the final norm (32) and the LM head 96x32 = 3,072; the embedding is a lookup.
    frozen = 2 * per_layer + 32 + 3072
    assert frozen == 19680
    # Adapters of rank 4: q_proj A 4x32 + B 32x4 = 256, v_proj A 4x32 + B 16x4 = 192, in 2 layers.
    adapters = 2 * (256 + 192)
    assert lora.parameter_counts(model)["trainable_params"] == adapters == 896
    assert full == 6 * frozen  # full fine-tuning: 6 per weight a token goes through
    # LoRA: a frozen weight costs its forward and input gradient (4), an adapter all 6.
    assert lora.flops_per_token(full, model) == pytest.approx(4 * frozen + 6 * adapters) == 84_096


def test_they_agree_with_the_estimate():
    """The estimate counts the active experts' weights from the config alone (norms left out: 1% here)."""
    from trainlift.estimate.memory import Workload
    from trainlift.estimate.shape import shape_of
    from trainlift.estimate.timing import model_flops_per_token

    config = AutoConfig.for_model(**QWEN3_MOE)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    full = step_flops(model)
    model = lora.apply(model, LoraSection(r=4, target_modules=["q_proj", "v_proj"]))
    adapters = shape_of(config).lora_params(4, ["q_proj", "v_proj"])
    assert adapters == lora.parameter_counts(model)["trainable_params"]
    w = Workload(1, 1, 1, "none", gpu=True, bf16=True, workers=1, lora_params=adapters)  # 1 position: weights dominate
    recipe = lora.flops_per_token(full.base, model) + full.attention * 1
    assert recipe == pytest.approx(model_flops_per_token(shape_of(config), w), rel=0.02)
