"""DPO on packed preference rows: row checks, tokenization, pair-aware packing, the loss and its rewards against a
hand computation, the reference log-probs' file, and a training step normalised by the global pair count."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from trainlift.config.data import DataSource
from trainlift.config.job import DpoSection, validate_job_spec
from trainlift.errors import SpecError, UsageError
from trainlift.train.data import examples as data, preference
from trainlift.train.model import preference_loss

REPO = Path(__file__).resolve().parents[2]
PROMPT = [{"role": "user", "content": "reverse a b c"}]
DPO = DpoSection(beta=0.3, label_smoothing=0.1, sft_weight=0.5)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(REPO / "examples" / "tiny" / "tokenizer")


def trained_text(tokenizer, example: data.Example) -> str:
    return tokenizer.decode([t for t, label in zip(example.input_ids, example.labels) if label != data.IGNORE])


def write_rows(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.mark.parametrize("row, message", [
    ({"prompt": "p", "chosen": "c"}, "missing rejected for data.format=preference"),
    ({"prompt": 3, "chosen": "c", "rejected": "r"}, "prompt must be text or a list of {role, content} messages (got int)"),
    ({"prompt": "p", "chosen": ["c"], "rejected": "r"}, "chosen must be text or a list of {role, content} messages"),
    ({"prompt": PROMPT, "chosen": "c", "rejected": PROMPT}, "rejected must end with the assistant's turn (its last "
                                                             "role is user)"),
])
def test_a_bad_preference_row_is_one_line_naming_file_and_row(tmp_path, tokenizer, row, message):
    good = {"prompt": "p", "chosen": "c", "rejected": "r"}
    path = write_rows(tmp_path / "prefs.jsonl", [good, good, row, good])
    with pytest.raises(UsageError) as caught:
        preference.prepare(path, tokenizer, seq_len=64)
    text = str(caught.value)
    assert text.startswith(f"{path}:3: {message}") and "\n" not in text


def test_a_reply_that_only_repeats_the_prompt_is_refused(tmp_path, tokenizer):
    conversation = PROMPT + [{"role": "assistant", "content": "c b a"}]
    path = write_rows(tmp_path / "prefs.jsonl", [{"prompt": conversation, "chosen": "x", "rejected": conversation}])
    with pytest.raises(UsageError, match=r"prefs\.jsonl:1: rejected repeats the prompt but holds no reply after it"):
        preference.prepare(path, tokenizer, seq_len=64)


def test_rows_of_another_format_are_refused_naming_their_source(tmp_path, tokenizer):
    prefs = write_rows(tmp_path / "prefs.jsonl", [{"prompt": "p", "chosen": "c", "rejected": "r"}])
    chat = write_rows(tmp_path / "chat.jsonl", [{"messages": PROMPT + [{"role": "assistant", "content": "c"}]}])
    mixture = data.mixture([DataSource(source=prefs), DataSource(source=chat)], "auto", size=8)
    with pytest.raises(UsageError, match=rf"data.train\[1\]: train.objective: dpo learns from preference rows "
                                         rf"\(prompt, chosen, rejected\), but {chat} holds messages rows"):
        list(preference.packed_rows(mixture, tokenizer, 64))
    packed = preference.prepare(prefs, tokenizer, seq_len=64)
    assert len(packed.rows) == 1 and list(packed.examples_per_row[0]) == [0, 1]


def test_prompts_are_masked_and_replies_trained_whatever_shape_the_row_has(tokenizer):
    """Text and conversation prompts; replies as text, as the assistant's turn alone, or as the whole conversation:
    the same examples for the same conversation. An assistant turn of the prompt is not trained."""
    reply_turn = [{"role": "assistant", "content": "c b a"}]
    rows = [{"prompt": PROMPT, "chosen": "c b a", "rejected": PROMPT + [{"role": "assistant", "content": "a b c"}]},
            {"prompt": PROMPT, "chosen": reply_turn, "rejected": "a b c"},
            {"prompt": "reverse a b c =", "chosen": " c b a", "rejected": " a b c"},
            {"prompt": PROMPT + reply_turn + PROMPT, "chosen": "c b a", "rejected": "a b c"}]
    pairs = preference.to_pairs(rows, tokenizer)
    assert [(trained_text(tokenizer, c), trained_text(tokenizer, r)) for c, r in pairs] == [
        ("c b a<|endoftext|>", "a b c<|endoftext|>"), ("c b a<|endoftext|>", "a b c<|endoftext|>"),
        (" c b a<|endoftext|>", " a b c<|endoftext|>"), ("c b a<|endoftext|>", "a b c<|endoftext|>")]
    assert pairs[0][0] == pairs[1][0] and pairs[0][1] == pairs[1][1]
    assert tokenizer.decode(pairs[0][0].input_ids) == "<|user|>\nreverse a b c\n<|assistant|>\nc b a<|endoftext|>"
    assert tokenizer.decode(pairs[3][0].input_ids).count("c b a") == 2  # the prompt's answer is there, masked


def test_a_chat_template_renders_the_conversation_when_the_tokenizer_has_one(tokenizer):
    templated = AutoTokenizer.from_pretrained(REPO / "examples" / "tiny" / "tokenizer")
    templated.chat_template = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% if m.role == 'assistant' %}"
                               "<|endoftext|>{% endif %}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    (chosen, rejected), = preference.to_pairs([{"prompt": PROMPT, "chosen": "c b a", "rejected": "a b c"}], templated)
    assert templated.decode(chosen.input_ids) == "[user]reverse a b c[assistant]c b a<|endoftext|>"
    assert trained_text(templated, rejected) == "a b c<|endoftext|>"


def example(n: int, start: int) -> data.Example:
    ids = [(start + t) % 90 + 5 for t in range(n)]
    return data.Example(ids, [data.IGNORE] * (n // 2) + ids[n // 2:])


def test_packing_keeps_pairs_whole_alternating_and_restarts_positions():
    lengths = [(5, 7), (9, 4), (3, 3), (12, 10), (6, 2), (40, 30)]
    pairs = [(example(c, 10 * i), example(r, 10 * i + 5)) for i, (c, r) in enumerate(lengths)]
    rows = list(preference.pack_pairs(pairs, seq_len=24, pad_id=1))
    assert [m for _, members, _ in rows for m in members] == list(range(2 * len(pairs)))
    for row, members, _ in rows:
        assert len(row["input_ids"]) == 24 and members[0] % 2 == 0 and len(members) % 2 == 0
        owners, counts = preference.example_layout([row])
        assert len(counts) == len(members)  # the examples are found again from the restarting positions
        for k, index in enumerate(members):
            pair, which = divmod(index, 2)
            want = pairs[pair][which].input_ids[:row["num_tokens"]]
            got = [t for t, o in zip(row["input_ids"], owners[0]) if o == k]
            assert got == want[:len(got)] and got[0] == want[0]
            assert [p for p, o in zip(row["position_ids"], owners[0]) if o == k] == list(range(len(got)))
    last, members, truncated = rows[-1]
    assert members == [10, 11] and truncated == 2 and last["num_tokens"] == 24  # 40 + 30 cut to 12 + 12


def tiny_model():
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=96, tie_word_embeddings=False)
    return Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa")


def packed_pairs(seq_len: int = 32) -> tuple[list[dict], list[tuple[data.Example, data.Example]]]:
    pairs = [(example(c, 7 * i), example(r, 7 * i + 3)) for i, (c, r) in enumerate([(6, 9), (8, 5), (7, 7), (10, 4)])]
    return [row for row, _, _ in preference.pack_pairs(pairs, seq_len, pad_id=0)], pairs


def hand_logps(model, ex: data.Example) -> torch.Tensor:
    """One example alone: plain log_softmax over its logits, summed over its trained tokens."""
    logits = model(input_ids=torch.tensor([ex.input_ids])).logits[0, :-1]
    targets = torch.tensor(ex.labels[1:])
    token_logps = F.log_softmax(logits.float(), dim=-1).gather(1, targets.clamp(min=0)[:, None])[:, 0]
    return (token_logps * (targets != data.IGNORE)).sum()


def test_dpo_loss_and_rewards_equal_a_hand_computation_on_a_packed_batch():
    """Two rows holding four pairs, one forward: the same log-probs as each example alone (chunked head: several
    chunks), and the loss (label smoothing and the SFT term included) and rewards of the formula, gradients too."""
    model = tiny_model()
    rows, pairs = packed_pairs()
    assert len(rows) == 2
    reference = np.linspace(-30.0, -20.0, 2 * len(pairs))
    batch = preference_loss.with_pairs(data.collate(rows), rows, reference)
    assert batch["pairs"] == 4
    chunked = preference_loss.sequence_logps(model, batch, chunk_elements=96 * 5)
    alone = torch.stack([hand_logps(model, ex) for pair in pairs for ex in pair])
    torch.testing.assert_close(chunked, alone, rtol=1e-5, atol=1e-5)

    loss, sums = preference_loss.dpo_loss_sum(model, batch, DPO)
    ref = torch.tensor(reference, dtype=torch.float32)
    chosen, rejected = 0.3 * (alone[0::2] - ref[0::2]), 0.3 * (alone[1::2] - ref[1::2])
    margin = chosen - rejected
    trained = torch.tensor([sum(t != data.IGNORE for t in c.labels[1:]) for c, _ in pairs], dtype=torch.float32)
    want = (-F.logsigmoid(margin) * 0.9 - F.logsigmoid(-margin) * 0.1 - 0.5 * alone[0::2] / trained).sum()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sums, torch.stack([chosen.sum(), rejected.sum(), margin.sum(),
                                                  (chosen > rejected).float().sum()]).detach(), rtol=1e-5, atol=1e-5)
    assert 0 < sums[3] < 4  # some pairs ranked right, some wrong: the accuracy is not trivially all or none

    grads = torch.autograd.grad(loss, list(model.parameters()))
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def test_the_reference_file_is_read_only_whole_and_for_the_same_examples(tmp_path):
    fs, path = pafs.LocalFileSystem(), preference_loss.reference_path(str(tmp_path / "run"), "train", "abc")
    assert preference_loss.read_reference(fs, path, 3) is None
    preference_loss.write_reference(fs, path, np.array([-1.5, -2.0, -3.25]))
    np.testing.assert_array_equal(preference_loss.read_reference(fs, path, 3), [-1.5, -2.0, -3.25])
    assert preference_loss.read_reference(fs, path, 4) is None  # another split's rows
    assert [p.name for p in (tmp_path / "run" / "reference").iterdir()] == ["train-abc.npy"]  # no partial left
    Path(path).write_bytes(Path(path).read_bytes()[:-5])  # cut short (not by trainlift: it moves a whole file)
    assert preference_loss.read_reference(fs, path, 3) is None


def test_a_dpo_step_is_normalised_by_the_global_pair_count_and_reads_the_device_once(single_process_group,
                                                                                      monkeypatch):
    """The same four pairs as one micro-batch or as two (the split grad_accum and the workers make): the same loss,
    rewards and gradients. A DPO step, like an SFT one, reads the device back once."""
    from trainlift.train.model.build import apply_fsdp
    from trainlift.train.model.objectives import loss_for
    from trainlift.train.recipe import queue_step, read_step, train_step

    spec = validate_job_spec({"model": {"path": "m"}, "data": {"train": "t.jsonl", "format": "preference"},
                              "train": {"objective": "dpo", "dpo": DPO.model_dump()}})
    rows, pairs = packed_pairs(seq_len=24)
    assert len(rows) == 4
    objective = dataclasses.replace(loss_for(spec), references={"train": np.linspace(-30.0, -20.0, 2 * len(pairs))})
    packed = data.Packed(rows, [m for _, m, _ in preference.pack_pairs(pairs, 24, 0)])
    results = []
    for split in ([[0, 1, 2, 3]], [[0, 1], [2, 3]]):
        model = apply_fsdp(tiny_model(), torch.device("cpu"), bf16=False, activation_checkpointing=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        grads: list = []
        optimizer.register_step_pre_hook(lambda *_, model=model, grads=grads: grads.append(
            [p.grad.full_tensor().clone() for p in model.parameters()]))
        batches = [objective.batch_of(packed, rows_of) for rows_of in split]
        result = read_step(queue_step(model, optimizer, scheduler, batches, 1e9, 1, torch.device("cpu"),
                                      objective=objective), objective.metrics)
        results.append((result, grads[0]))
        if len(split) == 2:
            reads = counting_reads(monkeypatch)
            train_step(model, optimizer, scheduler, batches, 1e9, 1, torch.device("cpu"), objective=objective)
            assert len(reads) == 1 and reads[0].startswith("tolist in recipe.py"), reads
    (whole, whole_grads), (halves, halves_grads) = results
    assert whole.loss == pytest.approx(halves.loss, rel=1e-6) and whole.loss > 0
    for got, expected in zip(halves_grads, whole_grads):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    assert set(whole.metrics) == {"rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy"}
    for name, value in whole.metrics.items():
        assert halves.metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    assert whole.tokens == sum(r["num_tokens"] for r in rows)


def counting_reads(monkeypatch) -> list[str]:
    """Host reads of device tensors made by trainlift's own code, as tests/unit/test_host_reads.py counts them."""
    import sys

    src, calls = str(REPO / "src" / "trainlift"), []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(src):
                calls.append(f"{_name} in {Path(caller).name}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return calls


def test_dpo_needs_preference_rows_and_preference_rows_need_dpo():
    base = {"model": {"path": "m"}, "data": {"train": "t.jsonl"}}
    with pytest.raises(SpecError, match="train.objective: dpo learns from pairs of responses, but data.format is "
                                        "messages; set data.format: preference"):
        validate_job_spec({**base, "data": {"train": "t.jsonl", "format": "messages"}, "train": {"objective": "dpo"}})
    with pytest.raises(SpecError, match="data.format: preference rows are pairs for train.objective: dpo"):
        validate_job_spec({**base, "data": {"train": "t.jsonl", "format": "preference"}})
    with pytest.raises(SpecError, match=r"train.dpo.label_smoothing: Input should be less than 0.5"):
        validate_job_spec({**base, "data": {"train": "t.jsonl", "format": "preference"},
                           "train": {"objective": "dpo", "dpo": {"label_smoothing": 0.5}}})


def test_the_objective_is_recorded_for_dpo_runs_only():
    from trainlift.train.run import spec_record

    base = {"model": {"path": "m"}, "data": {"train": "t.jsonl"}}
    sft = spec_record.training_fields(validate_job_spec(base), "abc")
    assert not [f for f in sft if f.startswith(("train.objective", "train.dpo"))]
    dpo = spec_record.training_fields(validate_job_spec({
        "model": {"path": "m"}, "data": {"train": "t.jsonl", "format": "preference"},
        "train": {"objective": "dpo", "dpo": {"beta": 0.2}}}), "abc")
    assert dpo["train.objective"] == "dpo" and dpo["train.dpo.beta"] == 0.2 and "train.dpo.sft_weight" in dpo


def test_the_rewards_reach_the_trackers_under_train_and_eval_tags():
    from trainlift.train.run import trackers

    assert trackers.REWARDS == preference_loss.METRICS  # the driver's copy: it imports no torch
    row = {"step": 3, "loss": 0.5, "rewards/accuracy": 0.75, "rewards/margin": 0.25, "eval_rewards/accuracy": 1.0}
    assert trackers.scalars(row) == {"train/loss": 0.5, "train/rewards/accuracy": 0.75, "train/rewards/margin": 0.25,
                                     "eval/rewards/accuracy": 1.0}
