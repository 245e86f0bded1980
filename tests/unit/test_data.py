"""The data pipeline: chat formatting, masking, packing, deterministic disjoint sharding, bad rows."""

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from trainlift.errors import UsageError
from trainlift.train.data import examples as data

REPO = Path(__file__).resolve().parents[2]
CHAT = {"messages": [{"role": "user", "content": "reverse abc"}, {"role": "assistant", "content": "cba"}]}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(REPO / "examples" / "tiny" / "tokenizer")


def trained_text(tokenizer, ex):
    return tokenizer.decode([t for t, lab in zip(ex.input_ids, ex.labels) if lab != data.IGNORE])


def test_prompt_tokens_are_masked_and_answer_trained(tokenizer):
    ex = data.to_example(CHAT, "messages", tokenizer)
    assert trained_text(tokenizer, ex) == "cba<|endoftext|>"
    assert tokenizer.decode(ex.input_ids).startswith("<|user|>\nreverse abc\n<|assistant|>\n")


def test_chat_template_is_used_when_the_tokenizer_has_one(tokenizer):
    templated = AutoTokenizer.from_pretrained(REPO / "examples" / "tiny" / "tokenizer")
    templated.chat_template = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% if m.role == 'assistant' %}"
                               "<|endoftext|>{% endif %}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    ex = data.to_example(CHAT, "messages", templated)
    assert tokenizer.decode(ex.input_ids) == "[user]reverse abc[assistant]cba<|endoftext|>"
    assert trained_text(tokenizer, ex) == "cba<|endoftext|>"


def test_prompt_completion_and_text_formats(tokenizer):
    ex = data.to_example({"prompt": "add 1 2 =", "completion": " 3"}, "prompt_completion", tokenizer)
    assert trained_text(tokenizer, ex) == " 3<|endoftext|>"
    ex = data.to_example({"text": "hello"}, "text", tokenizer)
    assert trained_text(tokenizer, ex) == "hello<|endoftext|>"


def test_packing_keeps_every_example_whole_and_in_order():
    examples = [data.Example(list(range(n)), list(range(n))) for n in (5, 9, 3, 12, 7, 1, 16)]
    packed = data.pack(examples, seq_len=16, pad_id=99)
    assert sorted(i for members in packed.examples_per_row for i in members) == list(range(len(examples)))
    assert all(len(r["input_ids"]) == 16 for r in packed.rows)
    for row, members in zip(packed.rows, packed.examples_per_row):
        expected = [t for i in members for t in examples[i].input_ids]
        assert row["input_ids"][: len(expected)] == expected
        assert set(row["input_ids"][len(expected):]) <= {99}
        assert all(lab == data.IGNORE for lab in row["labels"][len(expected):])
    assert packed.truncated == 0 and packed.tokens == sum(len(e.input_ids) for e in examples)


def test_packing_truncates_and_counts_overlong_examples():
    packed = data.pack([data.Example(list(range(20)), list(range(20)))], seq_len=16, pad_id=0)
    assert packed.truncated == 1 and len(packed.rows) == 1


def test_position_ids_restart_per_example():
    packed = data.pack([data.Example([1, 2, 3], [1, 2, 3]), data.Example([4, 5], [4, 5])], seq_len=8, pad_id=0)
    assert packed.rows[0]["position_ids"][:5] == [0, 1, 2, 0, 1]


def test_sharding_gives_workers_disjoint_slices_covering_the_global_batch():
    indices = data.global_indices(n=50, seed=3, cursor=10, count=12)
    slices = [data.rank_slice(indices, r, 3) for r in range(3)]
    assert sum(slices, []) == indices
    assert all(not set(a) & set(b) for i, a in enumerate(slices) for b in slices[i + 1:])


def test_data_order_is_deterministic_and_reshuffled_each_epoch():
    first = data.global_indices(n=20, seed=7, cursor=0, count=40)
    assert first == data.global_indices(n=20, seed=7, cursor=0, count=40)
    assert sorted(first[:20]) == list(range(20)) and sorted(first[20:]) == list(range(20))
    assert first[:20] != first[20:]
    assert data.global_indices(n=20, seed=7, cursor=13, count=5) == first[13:18]


def test_eval_batches_are_equal_in_number_across_workers():
    per_rank = [data.worker_row_batches(5, r, 2, micro_batch=2) for r in range(2)]
    assert per_rank == [[[0, 2], [4]], [[1, 3], []]]  # rank 1 runs out first: an empty batch keeps it in step


def test_malformed_line_is_reported_as_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(CHAT) + "\n{not json\n")
    with pytest.raises(UsageError, match=r"train\.jsonl:2: not valid JSON"):
        data.read_jsonl(path, "messages")


def test_row_missing_the_format_keys_is_reported(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(UsageError, match=r"train\.jsonl:1: missing completion"):
        data.read_jsonl(path, "prompt_completion")
