"""Packed rows: several examples in one row, each restarting its position ids. Every attention kernel trainlift
picks must keep them apart: a packed row's logits equal each example's run alone. Checked here for the kernels
that run on a CPU (flash-attn needs a GPU; it reads the same position ids)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from trainlift.train.model.build import attention_implementation

CONFIG = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, vocab_size=96)


@pytest.mark.parametrize("kernel", ["sdpa", "eager", "flex_attention"])
def test_a_packed_rows_logits_equal_each_examples_alone(kernel):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIG, attn_implementation=kernel).eval()
    lengths = [10, 5, 9]
    ids = torch.randint(0, CONFIG.vocab_size, (1, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        alone, start = [], 0
        for n in lengths:
            part = slice(start, start + n)
            alone.append(model(input_ids=ids[:, part], position_ids=positions[:, part], use_cache=False).logits)
            start += n
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), rtol=1e-5, atol=1e-5)


def test_auto_picks_a_kernel_without_a_dense_mask_on_gpus_and_sdpa_on_cpus(monkeypatch):
    import importlib.util

    assert attention_implementation("auto", torch.device("cpu")) == "sdpa"
    assert attention_implementation("eager", torch.device("cuda")) == "eager"
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "flash_attn" else find_spec(name))
    assert attention_implementation("auto", torch.device("cuda")) == "flash_attention_2"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "flash_attn" else find_spec(name))
    assert attention_implementation("auto", torch.device("cuda")) == "flex_attention"
