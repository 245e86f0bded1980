"""Exact-match accuracy of a fine-tuned model: greedy answers against the reference answers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from trainlift.errors import UsageError
from trainlift.train.data.examples import chat_prompt, read_jsonl, starts_with_bos


def _prompt_and_answer(row: dict, tokenizer) -> tuple[str, str, str]:
    """(text shown to the model, the user-facing prompt, the expected answer)."""
    if "messages" in row:
        msgs = row["messages"]
        last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        return chat_prompt(msgs[:last], tokenizer), msgs[last - 1]["content"], msgs[last]["content"]
    return row["prompt"], row["prompt"], row["completion"]


def first_row(path: str) -> Any:
    """The JSONL file's first row; None when it is not JSON (read_jsonl reports the bad line)."""
    with open(path, encoding="utf-8") as fh:
        first = next((line for line in fh if line.strip()), "{}")
    try:
        return json.loads(first)
    except json.JSONDecodeError:
        return None


def _detect_format(path: str) -> str:
    row = first_row(path)
    return "prompt_completion" if row is not None and "messages" not in row else "messages"


def padding_tokenizer(model_dir: str):
    """The model's tokenizer, padding on the left; a tokenizer without a pad token pads with its eos token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise UsageError(f"{model_dir}: the tokenizer has neither a pad nor an eos token, so prompts cannot be "
                             "batched", hint="set pad_token in the model's tokenizer_config.json")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def prompt_ids(texts: list[str], tokenizer, fmt: str) -> list[list[int]]:
    """The prompts' token ids as training lays out the start of an example of `fmt` (its BOS included)."""
    bos = [tokenizer.bos_token_id] if starts_with_bos(tokenizer, fmt) else []
    return [bos + ids for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def exact_match(model_dir: str, data_file: str, limit: int = 200, max_new_tokens: int = 16,
                batch_size: int = 32) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if not (Path(model_dir) / "config.json").is_file():
        raise UsageError(f"{model_dir}: not an HF model directory (no config.json)",
                         hint="point at <run>/final after `trainlift train`")
    if not Path(data_file).is_file():
        raise UsageError(f"--data {data_file}: no such file",
                         hint="give a JSONL file in the messages or prompt_completion format")
    for name, value, least in (("--limit", limit, 1), ("--max-new-tokens", max_new_tokens, 1)):
        if value < least:
            raise UsageError(f"{name} {value}: must be at least {least}")
    fmt = _detect_format(data_file)
    rows = read_jsonl(data_file, fmt)[:limit]
    tokenizer = padding_tokenizer(model_dir)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hf_logging.disable_progress_bar()  # its "Loading weights" bar would sit between trainlift's own lines
    model = AutoModelForCausalLM.from_pretrained(model_dir).to(device).eval()
    triples = [_prompt_and_answer(r, tokenizer) for r in rows]
    tasks = [task_of(r) for r in rows]
    samples = []
    for start in range(0, len(triples), batch_size):
        chunk = triples[start:start + batch_size]
        enc = tokenizer.pad({"input_ids": prompt_ids([t for t, _, _ in chunk], tokenizer, fmt)},
                            return_tensors="pt").to(device)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        answers = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        for (_, prompt, expected), answer, task in zip(chunk, answers, tasks[start:start + batch_size]):
            answer = answer.strip()
            sample = {"prompt": prompt, "expected": expected, "answer": answer, "correct": answer == expected.strip()}
            samples.append({**sample, "task": task} if task is not None else sample)
    correct = sum(s["correct"] for s in samples)
    report = {"model": model_dir, "total": len(samples), "correct": correct,
              "accuracy": correct / len(samples) if samples else 0.0, "samples": samples}
    return {**report, "by_task": by_task(samples)} if any(t is not None for t in tasks) else report


TASK_FIELDS = ("task", "category")  # a row's label for the per-task breakdown, the first one present


def task_of(row: dict) -> str | None:
    return next((str(row[k]) for k in TASK_FIELDS if row.get(k) is not None), None)


def by_task(samples: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{task: {total, correct, accuracy}} in name order; rows without a label count under "(none)"."""
    counts: dict[str, list[int]] = {}
    for sample in samples:
        counts.setdefault(sample.get("task", "(none)"), []).append(int(sample["correct"]))
    return {task: {"total": len(hits), "correct": sum(hits), "accuracy": sum(hits) / len(hits)}
            for task, hits in sorted(counts.items())}
