"""The chunked loss against the plain one, and the streamed safetensors files, in one process (no ranks)."""

from __future__ import annotations

import json

import pyarrow.fs as pafs
import pytest
import torch


def test_chunked_loss_equals_plain_loss_and_gradients_over_many_chunks():
    """Tolerance: rtol 1e-5, atol 1e-6 (fp32; only the summation order differs)."""
    from trainlift.train.model.loss import chunked_token_loss_sum, plain_token_loss_sum

    generator = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 1000, bias=True)
    hidden = torch.randn(2, 30, 16, generator=generator, requires_grad=True)
    labels = torch.randint(0, 1000, (2, 30), generator=generator)
    labels[0, :9] = -100
    labels[1, 20:] = -100

    plain = plain_token_loss_sum(head(hidden), labels)
    plain_grads = torch.autograd.grad(plain, [hidden, head.weight, head.bias])
    chunked = chunked_token_loss_sum(hidden, head, labels, chunk_elements=5 * 1000)  # 5 tokens a chunk
    chunked_grads = torch.autograd.grad(chunked, [hidden, head.weight, head.bias])

    torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=1e-6)
    for got, want in zip(chunked_grads, plain_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                                        tie_word_embeddings=True))


def test_streamed_files_hold_every_weight_once_in_the_export_dtype(tmp_path):
    from safetensors.torch import load_file

    from trainlift.train.model.export import INDEX, model_weights, write_weights

    model = tiny_llama()
    names = write_weights(pafs.LocalFileSystem(), str(tmp_path), model_weights(model), torch.bfloat16, max_file_bytes=2048)
    index = json.loads((tmp_path / INDEX).read_text())
    assert len(names) > 1 and sorted(set(index["weight_map"].values())) == sorted(names)
    stored = {}
    for name in names:
        stored.update(load_file(tmp_path / name))
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: written once
    assert set(stored) == set(expected) == set(index["weight_map"])
    for key, tensor in expected.items():
        assert stored[key].dtype == torch.bfloat16
        assert torch.equal(stored[key], tensor.to(torch.bfloat16)), key
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in expected.values())


def test_loading_from_a_directory_without_safetensors_names_the_field(tmp_path):
    from trainlift.errors import SpecError
    from trainlift.train.model.weights import load_safetensors

    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(SpecError, match=r"^model.path: .*no \*\.safetensors files") as caught:
        load_safetensors(tiny_llama(), tmp_path)
    assert "save_pretrained" in caught.value.hint


def test_a_load_reads_the_files_headers_once_and_fills_every_weight(tmp_path, monkeypatch):
    """The key check and dcp.load share one read of the safetensors headers (on a 70B model: 30 files, each
    header parsed per rank)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from trainlift.train.model.export import model_weights, write_weights
    from trainlift.train.model.weights import load_safetensors

    source = tiny_llama()
    write_weights(pafs.LocalFileSystem(), str(tmp_path), model_weights(source), torch.float32, max_file_bytes=2048)
    reads = []
    original = HuggingFaceStorageReader.read_metadata
    monkeypatch.setattr(HuggingFaceStorageReader, "read_metadata",
                        lambda self, *a, **k: reads.append(1) or original(self, *a, **k))
    target = tiny_llama()
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()
    load_safetensors(target, tmp_path)
    assert len(reads) == 1
    for key, tensor in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], tensor), key
