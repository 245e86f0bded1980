"""How the chunked loss chunks: tokens a chunk from the element budget and the vocabulary (a GPU tile on CUDA), the
budget the caller gives, and the model asked for no logits of its own (the point of chunking)."""

from __future__ import annotations

from unittest import mock

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from trainlift.train.data import examples as data
from trainlift.train.model import loss


def test_tokens_a_chunk_are_the_element_budget_over_the_vocabulary_at_least_one():
    head = torch.nn.Linear(8, 50, bias=False)  # vocabulary 50, hidden 8
    hidden = torch.zeros(3, 8)
    assert loss.chunk_tokens(hidden, head, 100) == 2  # 100 // 50 (not 100 // 8)
    assert loss.chunk_tokens(hidden, head, 149) == 2
    assert loss.chunk_tokens(hidden, head, 60) == 1 and loss.chunk_tokens(hidden, head, 30) == 1
    on_gpu = mock.Mock(is_cuda=True)  # a CUDA tensor is only asked where it lives
    assert loss.chunk_tokens(on_gpu, head, 100) == loss.GPU_CHUNK_TOKENS == 1024


def tiny_model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                        num_attention_heads=2, num_key_value_heads=1,
                                                        vocab_size=50))


def batch():
    examples = [data.Example(ids, ids) for ids in ([3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14])]
    return data.collate(data.pack(examples, seq_len=16, pad_id=0).rows)


def test_the_model_computes_no_logits_of_its_own():
    model = tiny_model()
    inputs, _ = loss.model_inputs(model, batch())
    hidden, output = loss.head_forward(model, inputs, lambda h: h)
    assert hidden.shape == (1, 16, 32)
    assert output.logits.shape == (1, 0, 50)


def test_the_callers_element_budget_sets_the_chunks(monkeypatch):
    model, budgets = tiny_model(), []
    real = loss.chunk_tokens

    def recording(hidden, head, chunk_elements):
        budgets.append(chunk_elements)
        return real(hidden, head, chunk_elements)

    monkeypatch.setattr(loss, "chunk_tokens", recording)
    with torch.no_grad():
        small = loss.token_loss_sum(model, batch(), chunk_elements=50 * 4)
        whole = loss.token_loss_sum(model, batch())
    assert budgets == [200, loss.CHUNK_ELEMENTS]
    torch.testing.assert_close(small, whole, rtol=1e-5, atol=1e-5)


def test_flex_attention_on_a_cpu_gets_rows_padded_to_whole_blocks_of_ignored_labels():
    """torch's CPU flex kernel misreads a tile whose length is 8 mod 16, so rows go in padded to a multiple of 128
    with an example of their own (restarting positions) whose labels are ignored; other kernels get the rows as
    they are."""
    from types import SimpleNamespace

    flex = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flex_attention"))
    sdpa = SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa"))
    for seq_len in (127, 16):
        rows = data.pack([data.Example([3, 4, 5], [3, 4, 5])], seq_len=seq_len, pad_id=0).rows
        batch = data.collate(rows)
        inputs, labels = loss.model_inputs(flex, batch)
        pad = 128 - seq_len
        assert inputs["input_ids"].tolist() == [[3, 4, 5] + [0] * (seq_len - 3) + [0] * pad]
        assert labels.tolist() == [[data.IGNORE, 4, 5] + [data.IGNORE] * (seq_len - 3 + pad)]
        assert inputs["position_ids"].tolist() == [[0, 1, 2] + list(range(seq_len - 3)) + list(range(pad))]
        assert loss.laid_out(flex, batch["labels"], -7).tolist()[0][seq_len:] == [-7] * pad
        plain, plain_labels = loss.model_inputs(sdpa, batch)
        assert plain["input_ids"].shape == plain_labels.shape == plain["position_ids"].shape == (1, seq_len)
    whole = data.collate(data.pack([data.Example(list(range(128)), list(range(128)))], 128, 0).rows)
    assert loss.model_inputs(flex, whole)[0]["input_ids"].shape == (1, 128)  # a whole block: no padding


def test_a_model_without_a_separate_linear_head_gets_its_own_logits_loss(monkeypatch):
    """Where the head cannot run a chunk at a time, the loss is the plain one over the model's own logits: the same
    sum, and an MoE's router loss from the same forward."""
    from transformers import AutoConfig

    model = tiny_model()
    with torch.no_grad():
        chunked = loss.token_loss_sum(model, batch(), chunk_elements=50 * 4)
        monkeypatch.setattr(loss, "chunked_head", lambda model: False)
        plain, aux = loss.token_loss_and_aux(model, batch())
        inputs, labels = loss.model_inputs(model, batch())
        logits = model(**inputs).logits
    want = torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=data.IGNORE,
                                             reduction="sum")
    torch.testing.assert_close(plain, want)
    torch.testing.assert_close(plain, chunked, rtol=1e-5, atol=1e-5)
    assert aux is None

    torch.manual_seed(0)
    moe = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "mixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=50, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True))
    with torch.no_grad():
        _, aux = loss.token_loss_and_aux(moe, batch())
        inputs, _ = loss.model_inputs(moe, batch())
        own = moe(**inputs).aux_loss
    assert aux is not None and float(own) > 0
    torch.testing.assert_close(aux, own)
    monkeypatch.undo()  # and through the chunked head, the router loss of the forward that ran it
    with torch.no_grad():
        _, chunked_aux = loss.token_loss_and_aux(moe, batch())
    torch.testing.assert_close(chunked_aux, own)


def test_the_head_is_chunked_only_where_it_is_a_linear_apart_from_the_decoder():
    from types import SimpleNamespace

    qwen = tiny_model()
    assert loss.chunked_head(qwen)
    own_decoder = SimpleNamespace(get_decoder=lambda: own_decoder, get_output_embeddings=lambda: torch.nn.Linear(2, 3))
    conv_head = SimpleNamespace(get_decoder=lambda: qwen.model, get_output_embeddings=lambda: torch.nn.Conv1d(2, 3, 1))
    assert not loss.chunked_head(own_decoder) and not loss.chunked_head(conv_head)


def test_a_family_that_reads_a_logit_attribute_its_own_way_gets_its_own_operation():
    """HyperCLOVA X multiplies by logits_scaling where Granite divides by it (families.yaml logits_by_family)."""
    from types import SimpleNamespace

    def config(model_type):
        return SimpleNamespace(model_type=model_type, get_text_config=lambda: SimpleNamespace(logits_scaling=4.0))

    logits = torch.tensor([[1.0, -2.0]])
    assert loss.logit_transform(config("hyperclovax"))(logits).tolist() == [[4.0, -8.0]]
    assert loss.logit_transform(config("granite"))(logits).tolist() == [[0.25, -0.5]]
