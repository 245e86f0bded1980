"""Packed rows: several examples in one row, each restarting its position ids. Every attention kernel trainlift
picks must keep them apart: a packed row's logits equal each example's run alone. Checked here for the kernels
that run on a CPU (flash-attn needs a GPU; it reads the same position ids), through the inputs the training
recipe gives the model (`loss.model_inputs`, `loss.token_loss_sum`)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from trainlift.train.data import examples as data
from trainlift.train.model.loss import model_inputs, token_loss_sum

CONFIG = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, vocab_size=96)
KERNELS = ["sdpa", "eager", "flex_attention"]
# Rows of 24 tokens: torch 2.13's CPU flex kernel gets rows 8 mod 16 long wrong unless trainlift pads them.
ONE_ROW = [[10, 5, 9]]
TWO_ROWS = [[10, 5, 9], [4, 20]]  # a micro-batch of two rows, packed differently


def model_for(kernel: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(copy.deepcopy(CONFIG), attn_implementation=kernel).eval()


def packed_batch(rows: list[list[int]]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG.vocab_size, (len(rows), sum(rows[0])), generator=generator)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": positions}


def logits(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's logits for the batch's tokens, given the model inputs as the training recipe builds them."""
    inputs, _ = model_inputs(model, batch)
    with torch.no_grad():
        return model(**inputs).logits[:, :batch["input_ids"].size(1)]


@pytest.mark.parametrize("rows", [ONE_ROW, TWO_ROWS], ids=["one_row", "two_rows"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_a_packed_rows_logits_equal_each_examples_alone(kernel, rows):
    model = model_for(kernel)
    batch = packed_batch(rows)
    packed = logits(model, batch)
    alone = torch.full_like(packed, float("nan"))
    for r, row in enumerate(rows):
        start = 0
        for n in row:
            part = slice(start, start + n)
            alone[r, part] = logits(model, {k: v[r:r + 1, part] for k, v in batch.items()})[0]
            start += n
    assert torch.isfinite(packed).all()
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_flex_attention_loss_of_packed_rows_is_the_sum_of_each_examples_alone():
    """The training loss itself (`token_loss_sum`, chunked over the decoder's hidden states) on flex attention."""
    model = model_for("flex_attention")
    generator = torch.Generator().manual_seed(2)
    examples = [data.Example(ids, ids) for ids in
                (torch.randint(0, CONFIG.vocab_size, (n,), generator=generator).tolist() for n in (10, 5, 9, 4, 20))]
    rows = data.pack(examples, seq_len=24, pad_id=0).rows
    assert [r["num_tokens"] for r in rows] == [24, 24]
    with torch.no_grad():
        together = token_loss_sum(model, data.collate(rows))
        apart = sum(token_loss_sum(model, data.collate(data.pack([ex], len(ex.input_ids), 0).rows))
                    for ex in examples)
    assert torch.isfinite(together)
    torch.testing.assert_close(together, apart, rtol=1e-5, atol=1e-5)


def test_flash_attention_gets_a_micro_batch_as_one_row_that_transformers_reads_as_packed():
    """flash-attn kernels keep packed examples apart only in a batch of one row: transformers' own test
    (`_is_packed_sequence`, the one its flash-attention path runs) says no for two rows and yes for them flattened,
    and the cu_seqlens it then builds are the examples', none across rows. No flash-attn runs here; the flattened
    inputs are run through sdpa, which honours packed position ids in one row, and give the same training loss."""
    from types import SimpleNamespace

    from transformers.modeling_flash_attention_utils import _is_packed_sequence, prepare_fa_kwargs_from_position_ids

    batch = packed_batch(TWO_ROWS)
    flash = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))
    inputs, labels = model_inputs(flash, batch)
    assert inputs["input_ids"].shape == inputs["position_ids"].shape == labels.shape == (1, 48)
    assert not _is_packed_sequence(batch["position_ids"], batch_size=2)  # what flash-attn would have been given
    assert _is_packed_sequence(inputs["position_ids"], batch_size=1)
    (cu_q, _), _ = prepare_fa_kwargs_from_position_ids(inputs["position_ids"])
    assert cu_q.tolist() == [0, 10, 15, 24, 28, 48]

    model = model_for("sdpa")
    generator = torch.Generator().manual_seed(3)
    examples = [data.Example(ids, ids) for ids in
                (torch.randint(0, CONFIG.vocab_size, (n,), generator=generator).tolist() for n in (10, 5, 9, 4, 20))]
    rows = data.collate(data.pack(examples, seq_len=24, pad_id=0).rows)
    flat_inputs, flat_labels = model_inputs(flash, rows)
    with torch.no_grad():
        out = model(**flat_inputs).logits
        together = torch.nn.functional.cross_entropy(out[0, :-1].float(), flat_labels[0, 1:], ignore_index=-100,
                                                     reduction="sum")
        apart = sum(token_loss_sum(model, data.collate(data.pack([ex], len(ex.input_ids), 0).rows))
                    for ex in examples)
    torch.testing.assert_close(together, apart, rtol=1e-5, atol=1e-5)
