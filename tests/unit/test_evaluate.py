"""`trainlift eval` (exact match) on tokenizers whatever their pad token: none at all, or id 0."""

from __future__ import annotations

import shutil

import pytest
from transformers import AutoTokenizer, GenerationMixin

from trainlift.errors import UsageError
from trainlift.evaluate import exact_match


@pytest.fixture
def model_with_tokenizer(tiny_assets, tmp_path):
    """A copy of the tiny model whose tokenizer the test rewrites."""

    def make(**tokens) -> str:
        out = tmp_path / "model"
        shutil.copytree(tiny_assets / "model", out)
        tokenizer = AutoTokenizer.from_pretrained(out)
        for name, value in tokens.items():
            setattr(tokenizer, name, value)
        tokenizer.save_pretrained(out)
        return str(out)

    return make


@pytest.fixture
def generate_calls(monkeypatch):
    """The keyword arguments of every `generate` call (the real one still runs)."""
    calls = []
    real = GenerationMixin.generate

    def recording(self, *args, **kwargs):
        calls.append(kwargs)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", recording)
    return calls


def test_eval_pads_with_eos_when_the_tokenizer_has_no_pad_token(model_with_tokenizer, tiny_assets, generate_calls):
    model_dir = model_with_tokenizer(pad_token=None)
    assert AutoTokenizer.from_pretrained(model_dir).pad_token is None
    report = exact_match(model_dir, str(tiny_assets / "eval.jsonl"), limit=4, max_new_tokens=2, batch_size=4)
    assert report["total"] == 4 and len(report["samples"]) == 4
    eos = AutoTokenizer.from_pretrained(model_dir).eos_token_id
    assert [call["pad_token_id"] for call in generate_calls] == [eos]


def test_eval_keeps_a_pad_token_whose_id_is_zero(model_with_tokenizer, tiny_assets, generate_calls):
    """Pad id 0 is a real id (here eos is 1): it must not be swapped for eos as if it were missing."""
    model_dir = model_with_tokenizer(pad_token="<|endoftext|>", eos_token="<|pad|>")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1)
    exact_match(model_dir, str(tiny_assets / "eval.jsonl"), limit=2, max_new_tokens=2, batch_size=2)
    assert [call["pad_token_id"] for call in generate_calls] == [0]


def test_eval_refuses_a_tokenizer_without_pad_and_eos_tokens(model_with_tokenizer, tiny_assets):
    model_dir = model_with_tokenizer(pad_token=None, eos_token=None)
    with pytest.raises(UsageError, match="neither a pad nor an eos token"):
        exact_match(model_dir, str(tiny_assets / "eval.jsonl"), limit=2)
