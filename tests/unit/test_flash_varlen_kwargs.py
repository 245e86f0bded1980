"""flash-attn kernels get a micro-batch's example boundaries once, from `loss.model_inputs`, as transformers' own
`DataCollatorWithFlattening(return_flash_attn_kwargs=True)` gives them (`cu_seq_lens_q/k` int32 from 0,
`max_length_q/k` Python ints); from position ids alone transformers recomputes them in every layer, a
device-to-host sync each time and a graph break in a compiled block.

No flash-attn here: transformers' flash path runs with a stand-in for flash-attn's variable-length kernel that
attends within each [cu_seqlens[i], cu_seqlens[i+1]) span with sdpa, and transformers' recomputation from position
ids made to fail; the logits equal the sdpa model's."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, Qwen2Config

from trainlift.train.model.loss import model_inputs

CONFIG = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, vocab_size=96)
FLASH = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))
ROWS = [[10, 5, 9], [4, 20]]  # two rows of 24 tokens, each packed with examples of these lengths


def packed_batch(rows: list[list[int]]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG.vocab_size, (len(rows), sum(rows[0])), generator=generator)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": positions}


@pytest.mark.parametrize("rows", [ROWS, ROWS[:1]], ids=["two_rows", "one_row"])
def test_the_flash_kwargs_are_transformers_own_for_the_same_examples(rows):
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    batch = packed_batch(rows)
    inputs, _ = model_inputs(FLASH, batch)
    examples = [{"input_ids": list(range(n))} for row in rows for n in row]
    flattened = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_tensors="pt")(examples)
    (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(inputs["position_ids"])
    for name, cu in (("cu_seq_lens_q", cu_q), ("cu_seq_lens_k", cu_k)):
        assert inputs[name].dtype == flattened[name].dtype == torch.int32
        assert inputs[name].tolist() == flattened[name].tolist() == cu.tolist()
    for name, longest in (("max_length_q", max_q), ("max_length_k", max_k)):
        assert type(inputs[name]) is int and inputs[name] == flattened[name] == int(longest)
    assert torch.equal(inputs["position_ids"], flattened["position_ids"])


def recording_varlen_kernel(calls: list):
    """A stand-in for flash-attn's variable-length kernel, with its signature: causal attention within each span,
    each call's boundaries recorded in `calls`."""

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False):
        calls.append((cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
        out = torch.empty_like(q)
        bounds = cu_seqlens_q.tolist()
        for start, end in zip(bounds, bounds[1:]):
            qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
            out[start:end] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=softmax_scale,
                                                            enable_gqa=True).transpose(0, 1)
        return out

    return flash_attn_varlen_func


def test_transformers_flash_path_takes_them_in_every_layer_without_recomputing(monkeypatch):
    import transformers.modeling_flash_attention_utils as fa

    calls = []
    varlen = recording_varlen_kernel(calls)

    def loaded(implementation, *args, **kwargs):
        return (None, varlen, None, fa._pad_input, fa._unpad_input), (fa._lazy_define_process_function(varlen), None)

    def recomputed(*args, **kwargs):
        raise AssertionError("transformers recomputed the examples' boundaries from the position ids")

    monkeypatch.setattr(fa, "lazy_import_flash_attention", loaded)
    monkeypatch.setattr(fa, "_is_packed_sequence", recomputed)
    monkeypatch.setattr(fa, "prepare_fa_kwargs_from_position_ids", recomputed)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(CONFIG), attn_implementation="sdpa").eval()
    batch = packed_batch(ROWS)
    with torch.no_grad():
        expected = model(**model_inputs(model, batch)[0]).logits
        model.config._attn_implementation = "flash_attention_2"
        inputs, _ = model_inputs(model, batch)
        got = model(**inputs).logits
    assert len(calls) == CONFIG.num_hidden_layers
    for cu_q, cu_k, max_q, max_k in calls:
        assert cu_q is inputs["cu_seq_lens_q"] and cu_k is inputs["cu_seq_lens_k"]
        assert cu_q.tolist() == [0, 10, 15, 24, 28, 48] and max_q == max_k == 20
    torch.testing.assert_close(got.reshape(expected.shape), expected, rtol=1e-5, atol=1e-5)
