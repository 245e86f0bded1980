"""`trainlift eval` (exact match): its answers are what plain `model.generate` answers for each prompt alone, whatever
the batch or the tokenizer's pad token (none at all, or id 0), and its score is an exact comparison of those answers
with the references, on a model trained until it really answers (so the score meets real matches and real misses)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationMixin

from trainlift.errors import UsageError
from trainlift.evaluate import exact_match
from trainlift.train.data.examples import chat_prompt

REPO = Path(__file__).resolve().parents[2]
# The first six tasks of the demo's eval split: prompts of 13 to 18 tokens (as the simple chat template renders
# them), so a batch of them is padded.
TASKS = [json.loads(line) for line in (REPO / "examples" / "data" / "tasks-eval.jsonl").read_text().splitlines()[:6]]
ANSWERS = ["0 1 9", "a d f b b", "h j f", "38", "i a b", "1 7 8"]


def conversation(user: str, assistant: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: torch's second thread only waits on the first, and on a busy machine it costs 20x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def answering_model(tiny_assets, tmp_path_factory, one_thread) -> str:
    """The tiny model trained (plain torch, full batch, 150 AdamW steps: about 2 s) on the six tasks until its
    greedy answers to them are right; saved with its tokenizer."""
    out = tmp_path_factory.mktemp("answering") / "model"
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets / "model", padding_side="right")
    assert [t["messages"][-1]["content"] for t in TASKS] == ANSWERS
    texts = [chat_prompt(t["messages"][:-1], tokenizer) + t["messages"][-1]["content"] + tokenizer.eos_token
             for t in TASKS]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_assets / "model", dtype=torch.float32)
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(150):
        loss = model(**enc, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def plain_answer_ids(model_dir: str, prompt: str, max_new_tokens: int) -> list[int]:
    """The reference: `generate` on the prompt alone (no padding anywhere), greedy; the new token ids."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    enc = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=model.generation_config.eos_token_id)
    return out[0, enc["input_ids"].shape[1]:].tolist()


def plain_answer(model_dir: str, prompt: str, max_new_tokens: int = 16) -> str:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer.decode(plain_answer_ids(model_dir, prompt, max_new_tokens), skip_special_tokens=True)


def prompt_text(model_dir: str, task: dict) -> str:
    return chat_prompt(task["messages"][:-1], AutoTokenizer.from_pretrained(model_dir))


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def model_with_tokenizer(answering_model, tmp_path):
    """A copy of the answering model whose tokenizer the test rewrites."""

    def make(**tokens) -> str:
        out = tmp_path / "model"
        shutil.copytree(answering_model, out)
        tokenizer = AutoTokenizer.from_pretrained(out)
        for name, value in tokens.items():
            setattr(tokenizer, name, value)
        tokenizer.save_pretrained(out)
        return str(out)

    return make


@pytest.fixture
def generate_calls(monkeypatch):
    """(keyword arguments, output) of every `generate` call (the real one still runs)."""
    calls = []
    real = GenerationMixin.generate

    def recording(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls.append((kwargs, out))
        return out

    monkeypatch.setattr(GenerationMixin, "generate", recording)
    return calls


def assert_batched_tokens_are_the_alone_tokens(model_dir: str, call, prompts: list[str], max_new_tokens: int):
    """Each row of a batched `generate` holds exactly the tokens the prompt alone gets, then only padding."""
    kwargs, out = call
    assert len(out) == len(prompts)
    new = out[:, kwargs["input_ids"].shape[1]:].tolist()
    for row, prompt in zip(new, prompts):
        alone = plain_answer_ids(model_dir, prompt, max_new_tokens)
        assert row[:len(alone)] == alone, prompt
        assert set(row[len(alone):]) <= {kwargs["pad_token_id"]}, prompt


def test_eval_pads_with_eos_when_the_tokenizer_has_no_pad_token(model_with_tokenizer, tmp_path, generate_calls):
    model_dir = model_with_tokenizer(pad_token=None)
    assert AutoTokenizer.from_pretrained(model_dir).pad_token is None
    data = write_jsonl(tmp_path / "eval.jsonl", TASKS[:4])
    report = exact_match(model_dir, data, limit=4, max_new_tokens=16, batch_size=4)
    eos = AutoTokenizer.from_pretrained(model_dir).eos_token_id
    assert [kwargs["pad_token_id"] for kwargs, _ in generate_calls] == [eos]
    prompts = [prompt_text(model_dir, t) for t in TASKS[:4]]
    assert_batched_tokens_are_the_alone_tokens(model_dir, generate_calls[0], prompts, 16)
    assert [s["answer"] for s in report["samples"]] == ANSWERS[:4] == [plain_answer(model_dir, p) for p in prompts]


def test_eval_keeps_a_pad_token_whose_id_is_zero(model_with_tokenizer, tmp_path, generate_calls):
    """Pad id 0 is a real id (here eos is 1): it must not be swapped for eos as if it were missing."""
    model_dir = model_with_tokenizer(pad_token="<|endoftext|>", eos_token="<|pad|>")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1)
    data = write_jsonl(tmp_path / "eval.jsonl", TASKS[2:4] + TASKS[:2])
    report = exact_match(model_dir, data, limit=4, max_new_tokens=16, batch_size=2)
    assert [kwargs["pad_token_id"] for kwargs, _ in generate_calls] == [0, 0]
    prompts = [prompt_text(model_dir, t) for t in TASKS[2:4] + TASKS[:2]]
    for call, pair in zip(generate_calls, (prompts[:2], prompts[2:])):
        assert_batched_tokens_are_the_alone_tokens(model_dir, call, pair, 16)
    assert [s["answer"] for s in report["samples"]] == ANSWERS[2:4] + ANSWERS[:2]


def test_eval_refuses_a_tokenizer_without_pad_and_eos_tokens(model_with_tokenizer, tiny_assets):
    model_dir = model_with_tokenizer(pad_token=None, eos_token=None)
    with pytest.raises(UsageError) as refused:
        exact_match(model_dir, str(tiny_assets / "eval.jsonl"), limit=2)
    assert refused.value.message == (f"{model_dir}: the tokenizer has neither a pad nor an eos token, so prompts "
                                     "cannot be batched")
    assert refused.value.hint == "set pad_token in the model's tokenizer_config.json"


def test_exact_match_scores_plain_greedy_answers_by_exact_comparison(answering_model, tmp_path):
    """The score against an independent reference: each prompt's answer from `generate` alone, compared with the
    expected answer as strings (surrounding whitespace aside). The file holds real matches (the trained tasks), a
    match whose reference has a leading space, as prompt_completion rows often do, and real misses: a trained
    prompt with another answer expected, and answers that differ from the model's only in a space or a suffix."""
    rows = [
        TASKS[0],                                        # "0 1 9": a match
        conversation("add 29 9", " 38"),                 # the model answers "38": a match (whitespace aside)
        conversation("reverse f j h", "f j h"),          # the model answers "h j f": a miss
        TASKS[1],                                        # "a d f b b": a match
        conversation("reverse b a i", "iab"),            # the model answers "i a b": a miss, not a match by spaces
        conversation("sort 1 8 7", "1 7 8 9"),           # the model answers "1 7 8": a miss, not a prefix match
    ]
    data = write_jsonl(tmp_path / "eval.jsonl", rows)
    report = exact_match(answering_model, data, limit=6, max_new_tokens=16, batch_size=4)

    prompts = [prompt_text(answering_model, r) for r in rows]
    reference = [plain_answer(answering_model, p).strip() for p in prompts]
    assert reference == ["0 1 9", "38", "h j f", "a d f b b", "i a b", "1 7 8"]  # the model does answer
    expected = [r["messages"][-1]["content"] for r in rows]
    assert report["samples"] == [
        {"prompt": r["messages"][0]["content"], "expected": e, "answer": a, "correct": a == e.strip()}
        for r, e, a in zip(rows, expected, reference)]
    assert [s["correct"] for s in report["samples"]] == [True, True, False, True, False, False]
    assert (report["model"], report["total"], report["correct"]) == (answering_model, 6, 3)
    assert report["accuracy"] == 0.5


def test_exact_match_reads_prompt_completion_rows_and_honours_limit_and_max_new_tokens(answering_model, tmp_path):
    """prompt_completion rows are scored as given (no template applied); `limit` takes the first rows; the answers
    are cut at `max_new_tokens`, as plain `generate` cuts them."""
    prompts = [prompt_text(answering_model, t) for t in TASKS]
    rows = [{"prompt": p, "completion": a} for p, a in zip(prompts, ANSWERS)]
    data = write_jsonl(tmp_path / "eval.jsonl", rows)

    report = exact_match(answering_model, data, limit=5, max_new_tokens=16, batch_size=2)
    assert [s["prompt"] for s in report["samples"]] == prompts[:5]
    assert [s["answer"] for s in report["samples"]] == ANSWERS[:5]
    assert (report["total"], report["correct"], report["accuracy"]) == (5, 5, 1.0)

    short = exact_match(answering_model, data, limit=1, max_new_tokens=3, batch_size=1)
    cut = plain_answer(answering_model, prompts[0], max_new_tokens=3)
    assert cut == "0 1" and [s["answer"] for s in short["samples"]] == [cut]
    assert (short["total"], short["correct"], short["accuracy"]) == (1, 0, 0.0)


@pytest.mark.parametrize("option, value, message", [
    ("limit", 0, "--limit 0: must be at least 1"),
    ("max_new_tokens", 0, "--max-new-tokens 0: must be at least 1"),
])
def test_exact_match_refuses_options_below_one(answering_model, tmp_path, option, value, message):
    data = write_jsonl(tmp_path / "eval.jsonl", TASKS[:1])
    with pytest.raises(UsageError, match=message):
        exact_match(answering_model, data, **{option: value})


def test_exact_match_names_a_missing_model_or_data_file(answering_model, tmp_path):
    data = write_jsonl(tmp_path / "eval.jsonl", TASKS[:1])
    with pytest.raises(UsageError) as refused:
        exact_match(str(tmp_path), data)
    assert (refused.value.message, refused.value.hint) == (
        f"{tmp_path}: not an HF model directory (no config.json)", "point at <run>/final after `trainlift train`")
    with pytest.raises(UsageError) as refused:
        exact_match(answering_model, str(tmp_path / "missing.jsonl"))
    assert (refused.value.message, refused.value.hint) == (
        f"--data {tmp_path / 'missing.jsonl'}: no such file",
        "give a JSONL file in the messages or prompt_completion format")


def test_the_first_row_of_a_blank_file_is_empty(answering_model, tmp_path):
    """A file of blank lines has no first row: `{}`, and eval says the file has no examples."""
    from trainlift.evaluate import first_row

    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n")
    assert first_row(str(blank)) == {}
    with pytest.raises(UsageError, match="no examples in the file"):
        exact_match(answering_model, str(blank))


def test_eval_is_greedy_even_where_the_model_samples_by_default(tiny_assets, tmp_path):
    """Exported instruct models often ship `do_sample: true` in generation_config.json; the exact-match score
    is of the greedy answer all the same. Here on the untrained tiny model, whose flat distribution would make
    sampled answers differ from the greedy ones."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_assets / "model", model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.generation_config.do_sample, model.generation_config.temperature = True, 1.0
    model.generation_config.top_k, model.generation_config.top_p = 0, 1.0
    model.save_pretrained(model_dir)
    data = write_jsonl(tmp_path / "eval.jsonl", TASKS[:4])
    torch.manual_seed(0)
    report = exact_match(str(model_dir), data, limit=4, max_new_tokens=8, batch_size=4)
    greedy = [AutoTokenizer.from_pretrained(model_dir).decode(
        plain_greedy_ids(str(model_dir), prompt_text(str(model_dir), t), 8), skip_special_tokens=True).strip()
        for t in TASKS[:4]]
    assert [s["answer"] for s in report["samples"]] == greedy


def plain_greedy_ids(model_dir: str, prompt: str, max_new_tokens: int) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    enc = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, top_k=None, top_p=None,
                             temperature=None, pad_token_id=model.generation_config.eos_token_id)
    return out[0, enc["input_ids"].shape[1]:].tolist()


def test_eval_runs_on_the_gpu_where_there_is_one(answering_model, tmp_path, monkeypatch):
    """With CUDA available, the model and every batch go to the GPU (the moves are recorded here; the tokens
    stay on the CPU, where this machine computes them)."""
    from transformers import BatchEncoding

    moved = []

    def module_to(self, *args, **kwargs):
        moved.append(("model", args))
        return self

    def batch_to(self, device, **kwargs):
        moved.append(("batch", device))
        return self

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.nn.Module, "to", module_to)
    monkeypatch.setattr(BatchEncoding, "to", batch_to)
    data = write_jsonl(tmp_path / "eval.jsonl", TASKS[:3])
    report = exact_match(answering_model, data, limit=3, max_new_tokens=16, batch_size=2)
    cuda = torch.device("cuda")
    assert moved == [("model", (cuda,)), ("batch", cuda), ("batch", cuda)]
    assert [s["answer"] for s in report["samples"]] == ANSWERS[:3]


def test_eval_turns_off_the_loading_bar(answering_model, tmp_path):
    """The weights' "Loading weights" bar would sit between trainlift's own lines."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    try:
        exact_match(answering_model, write_jsonl(tmp_path / "eval.jsonl", TASKS[:1]), limit=1, max_new_tokens=1)
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def bos_model(answering_model: str, where: Path, chat_template: str | None = None) -> str:
    """The answering model with a tokenizer that has a BOS token its post-processor adds, as Llama's does."""
    from tokenizers import processors

    shutil.copytree(answering_model, where)
    tokenizer = AutoTokenizer.from_pretrained(where)
    tokenizer.bos_token = "<|system|>"
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single="<|system|> $A", special_tokens=[("<|system|>", tokenizer.bos_token_id)])
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(where)
    return str(where)


def prompt_ids_eval_feeds(call) -> list[list[int]]:
    """The prompt tokens of each row of a batched `generate` call, its padding left out."""
    kwargs, _ = call
    return [ids[mask.bool()].tolist() for ids, mask in zip(kwargs["input_ids"], kwargs["attention_mask"])]


def prompt_ids_training_has(model_dir: str, rows: list[dict], fmt: str) -> list[list[int]]:
    """What training puts before each answer: the example's tokens up to its first trained one."""
    from trainlift.train.data.examples import to_examples

    examples = to_examples(rows, fmt, AutoTokenizer.from_pretrained(model_dir))
    return [ex.input_ids[:next(i for i, label in enumerate(ex.labels) if label != -100)] for ex in examples]


def test_eval_feeds_the_prompt_tokens_training_put_before_the_answer(answering_model, tmp_path, generate_calls):
    """A chat template that writes the BOS itself: training adds none, and eval must not let the tokenizer add a
    second one either."""
    template = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    model_dir = bos_model(answering_model, tmp_path / "model", template)
    exact_match(model_dir, write_jsonl(tmp_path / "eval.jsonl", TASKS[:3]), limit=3, max_new_tokens=1, batch_size=3)
    bos = AutoTokenizer.from_pretrained(model_dir).bos_token_id
    fed = prompt_ids_eval_feeds(generate_calls[0])
    assert fed == prompt_ids_training_has(model_dir, TASKS[:3], "messages")
    assert [ids.count(bos) for ids in fed] == [1, 1, 1]


def test_eval_feeds_the_bos_training_put_before_a_prompt_completion_answer(answering_model, tmp_path,
                                                                           generate_calls):
    """prompt_completion rows (and the simple template's) start with the BOS in training: in eval too."""
    model_dir = bos_model(answering_model, tmp_path / "model")
    prompts = [prompt_text(answering_model, t) for t in TASKS[:2]]
    rows = [{"prompt": p, "completion": a} for p, a in zip(prompts, ANSWERS)]
    exact_match(model_dir, write_jsonl(tmp_path / "eval.jsonl", rows), limit=2, max_new_tokens=1, batch_size=2)
    assert prompt_ids_eval_feeds(generate_calls[0]) == prompt_ids_training_has(model_dir, rows, "prompt_completion")
