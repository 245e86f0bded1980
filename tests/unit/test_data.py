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
    """An example longer than seq_len keeps its first seq_len tokens (its prompt, not its end) in a row of its own;
    the examples around it are packed as usual."""
    packed = data.pack([data.Example(list(range(20)), list(range(20)))], seq_len=16, pad_id=0)
    assert packed.truncated == 1 and len(packed.rows) == 1 and packed.tokens == 16
    assert packed.rows[0] == {"input_ids": list(range(16)), "labels": [data.IGNORE] + list(range(1, 16)),
                              "position_ids": list(range(16)), "num_tokens": 16}

    long = data.Example(list(range(100, 120)), [data.IGNORE] * 5 + list(range(105, 120)))
    packed = data.pack([data.Example([1, 2, 3], [1, 2, 3]), long, data.Example([7, 8], [7, 8])], seq_len=16, pad_id=99)
    assert (packed.truncated, packed.tokens, packed.examples_per_row) == (1, 21, [[0], [1], [2]])
    assert [r["input_ids"] for r in packed.rows] == [
        [1, 2, 3] + [99] * 13, list(range(100, 116)), [7, 8] + [99] * 14]
    assert packed.rows[1]["labels"] == [data.IGNORE] * 5 + list(range(105, 116))
    assert [r["num_tokens"] for r in packed.rows] == [3, 16, 2]


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


def bos_tokenizer():
    """The demo tokenizer with a BOS token that its post-processor also adds, as Llama's does: trainlift adds the
    BOS itself (once) and must not let the tokenizer add another."""
    from tokenizers import processors

    tok = AutoTokenizer.from_pretrained(REPO / "examples" / "tiny" / "tokenizer")
    tok.bos_token = "<|system|>"
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<|system|> $A",
                                                                  special_tokens=[("<|system|>", tok.bos_token_id)])
    assert tok("ab")["input_ids"] == [tok.bos_token_id] + tok("ab", add_special_tokens=False)["input_ids"]
    return tok


def test_a_bos_token_starts_every_example_once_and_is_never_trained(tokenizer):
    tok = bos_tokenizer()
    bos, eos = tok.bos_token_id, tok.eos_token_id
    row = {"prompt": "ab", "completion": "cd"}
    ex = data.to_example(row, "prompt_completion", tok)
    ab, cd = (tok(text, add_special_tokens=False)["input_ids"] for text in ("ab", "cd"))
    assert ex.input_ids == [bos] + ab + cd + [eos]
    assert ex.labels == [data.IGNORE] * (1 + len(ab)) + cd + [eos]
    simple_chat = data.to_example(CHAT, "messages", tok)  # the simple template: a BOS too
    assert simple_chat.input_ids[0] == bos and simple_chat.input_ids.count(bos) == 1
    tok.chat_template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    templated = data.to_example(CHAT, "messages", tok)  # a chat template writes its own start: no BOS added
    assert tok.decode(templated.input_ids) == "[user]reverse abc[assistant]cba"
    assert bos not in templated.input_ids
    assert data.to_example(row, "prompt_completion", tok).input_ids == ex.input_ids  # other formats keep theirs


def test_rows_of_mixed_formats_are_tokenized_each_in_its_own(tokenizer):
    rows = [CHAT, {"prompt": "add 1 2 =", "completion": " 3"}, {"text": "hello"}]
    mixed = data.to_examples(rows, ["messages", "prompt_completion", "text"], tokenizer)
    alone = [data.to_example(r, f, tokenizer) for r, f in zip(rows, ["messages", "prompt_completion", "text"])]
    assert mixed == alone
    assert [trained_text(tokenizer, ex) for ex in mixed] == ["cba<|endoftext|>", " 3<|endoftext|>",
                                                             "hello<|endoftext|>"]
    assert data.to_examples([], "text", tokenizer) == []


def test_a_tokenizer_without_eos_trains_the_completion_alone(tokenizer):
    tok = AutoTokenizer.from_pretrained(REPO / "examples" / "tiny" / "tokenizer")
    tok.eos_token = None
    ex = data.to_example({"prompt": "add 1 2 =", "completion": " 3"}, "prompt_completion", tok)
    assert trained_text(tok, ex) == " 3"


def test_preference_rows_are_refused_for_next_token_training(tokenizer):
    with pytest.raises(UsageError) as refused:
        data.to_example({"prompt": "p", "chosen": "a", "rejected": "b"}, "preference", tokenizer)
    assert refused.value.message == ("data.format=preference: prompt, chosen and rejected rows train with a "
                                     "preference objective, not next-token fine-tuning")
    assert refused.value.hint == "give messages, alpaca, sharegpt, prompt_completion or text rows"


def test_the_generation_prompt_is_the_training_prompt(tokenizer):
    """What eval shows the model is what training put before the answer: the simple template's, or the chat
    template's with its generation prompt."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "reverse abc"}]
    assert data.chat_prompt(messages, tokenizer) == "<|system|>\nbe brief\n<|user|>\nreverse abc\n<|assistant|>\n"
    templated = AutoTokenizer.from_pretrained(REPO / "examples" / "tiny" / "tokenizer")
    templated.chat_template = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                               "{% if add_generation_prompt %}[assistant]{% endif %}")
    assert data.chat_prompt(messages, templated) == "[system]be brief[user]reverse abc[assistant]"


@pytest.mark.parametrize("pad, eos, expected", [(5, 7, 5), (0, 7, 0), (None, 7, 7), (None, None, 0)])
def test_rows_are_padded_with_the_pad_token_else_eos_else_zero(pad, eos, expected):
    from types import SimpleNamespace

    assert data.pad_id_of(SimpleNamespace(pad_token_id=pad, eos_token_id=eos)) == expected


def test_the_epoch_order_is_the_published_shuffle():
    """A resumed run continues the data order of the run it resumes, whatever trainlift release resumes it: the
    order of an epoch is Python's `random.Random(seed * 100_003 + epoch).shuffle` of 0..n-1, pinned here."""
    import random

    for seed, epoch in ((7, 0), (7, 1), (0, 3)):
        expected = list(range(12))
        random.Random(seed * 100_003 + epoch).shuffle(expected)
        assert data.epoch_order(12, seed, epoch) == expected
    assert data.epoch_order(12, 7, 1) == [6, 3, 0, 7, 8, 1, 9, 5, 10, 4, 2, 11]


def test_attended_pairs_of_a_row_that_does_not_start_an_example():
    """A row whose first tokens continue an example (its positions do not start at 0) counts them as an example of
    their own; an empty row attends to nothing."""
    import numpy as np

    assert data.attended_pairs(np.array([3, 4, 5, 0, 1])) == 3 ** 2 + 2 ** 2
    assert data.attended_pairs(np.array([7, 0, 1, 2])) == 1 ** 2 + 3 ** 2
    assert data.attended_pairs(np.array([], dtype=np.int64)) == 0


def test_a_truncated_example_is_counted_whatever_follows_it_in_its_row():
    """An example of no tokens (an empty text row, a tokenizer without EOS or BOS) fits after a truncated one."""
    packed = data.pack([data.Example(list(range(20)), list(range(20))), data.Example([], [])], seq_len=16, pad_id=0)
    assert packed.truncated == 1 and packed.examples_per_row == [[0, 1]]


def test_an_empty_example_leaves_the_labels_aligned():
    packed = data.pack([data.Example([1, 2, 3], [1, 2, 3]), data.Example([], []), data.Example([4, 5], [4, 5])],
                       seq_len=8, pad_id=0)
    assert packed.rows[0]["labels"] == [data.IGNORE, 2, 3, data.IGNORE, 5] + [data.IGNORE] * 3


MULTI_TURN = [{"role": "user", "content": "reverse ab"}, {"role": "assistant", "content": "ba"},
              {"role": "user", "content": "reverse cd"}, {"role": "assistant", "content": "dc"}]


def test_the_generation_prompt_of_a_later_turn_holds_the_earlier_turns(tokenizer):
    prompt = data.chat_prompt(MULTI_TURN[:3], tokenizer)
    assert prompt.startswith("<|user|>\nreverse ab\n<|assistant|>\nba")
    assert prompt.endswith("<|user|>\nreverse cd\n<|assistant|>\n")


def test_the_generation_prompt_of_a_later_turn_is_what_training_put_before_its_answer(tokenizer):
    ex = data.to_example({"messages": MULTI_TURN}, "messages", tokenizer)
    last_answer = tokenizer("dc<|endoftext|>", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ex.input_ids[:-len(last_answer)]) == data.chat_prompt(MULTI_TURN[:3], tokenizer)


def test_collate_counts_real_tokens_trained_labels_and_attended_pairs():
    """The step's token counts, taken on the host: real tokens (padding left out), labels a next-token prediction
    trains on (each row's first label predicts nothing), and each example's attended positions squared."""
    rows = data.pack([data.Example([1, 2, 3], [1, 2, 3]), data.Example([4, 5], [4, 5]),
                      data.Example([6, 7, 8, 9, 10, 11], [data.IGNORE, 7, 8, 9, 10, 11])],
                     seq_len=8, pad_id=0).rows
    batch = data.collate(rows)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 0, 0, 0], [6, 7, 8, 9, 10, 11, 0, 0]]
    # row 1: labels (-, 2, 3, -, 5, -, -, -): 2, 3 and 5; row 2: (-, 7, 8, 9, 10, 11, -, -): five (6 ignored)
    assert (batch["num_tokens"], batch["trainable_tokens"], batch["attended_pairs"]) == (11, 8, 3**2 + 2**2 + 6**2)
    # Rows that do not say how many tokens are real count all of them, padding (positions 0, 1, ...) as examples.
    bare = data.collate([{k: v for k, v in r.items() if k != "num_tokens"} for r in rows])
    assert (bare["num_tokens"], bare["attended_pairs"]) == (16, 3**2 + 2**2 + 3**2 + 6**2 + 2**2)


def test_without_an_eos_token_earlier_answers_end_with_nothing_in_training_and_in_eval():
    tok = AutoTokenizer.from_pretrained(REPO / "examples" / "tiny" / "tokenizer")
    tok.eos_token = None
    assert data.chat_prompt(MULTI_TURN[:3], tok) == ("<|user|>\nreverse ab\n<|assistant|>\nba"
                                                     "<|user|>\nreverse cd\n<|assistant|>\n")
    ex = data.to_example({"messages": MULTI_TURN}, "messages", tok)
    assert tok.decode(ex.input_ids) == data.chat_prompt(MULTI_TURN[:3], tok) + "dc"
