"""Regenerate the demo's data and tokenizer (deterministic; the outputs are committed).

    python examples/make_tiny_assets.py

Writes examples/data/tasks-{train,eval}.jsonl (short tasks a tiny model can
learn: reverse letters, sort digits, add numbers), examples/tiny/tokenizer/
(a byte-level BPE tokenizer trained on that data with `tokenizers`) and
examples/data/prefs-{train,eval}.jsonl: preference pairs on the same tasks for
`train.objective: dpo`, where the chosen reply is the answer alone and the
rejected one wraps the same answer in filler ("well, i think it is ...").
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

HERE = Path(__file__).resolve().parent
# Qwen2's pre-tokenizer (digits one by one), so that AutoTokenizer, which
# picks Qwen2Tokenizer for a Qwen2 model directory, tokenizes exactly like training.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIAL = ["<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]


def make_task(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(["reverse", "sort", "add"])
    if kind == "reverse":
        letters = [rng.choice("abcdefghij") for _ in range(rng.randint(3, 5))]
        return "reverse " + " ".join(letters), " ".join(reversed(letters))
    if kind == "sort":
        digits = [rng.randint(0, 9) for _ in range(rng.randint(3, 5))]
        return "sort " + " ".join(map(str, digits)), " ".join(map(str, sorted(digits)))
    a, b = rng.randint(0, 49), rng.randint(0, 49)
    return f"add {a} {b}", str(a + b)


def new_tasks(rng: random.Random, exclude: set[str]):
    """(prompt, answer) pairs whose prompts are not in `exclude` and not repeated, drawn from `rng` as they are
    asked for (a caller drawing from `rng` in between gets the same sequence every time)."""
    seen = set(exclude)
    while True:
        prompt, answer = make_task(rng)
        if prompt not in seen:
            seen.add(prompt)
            yield prompt, answer


def make_split(rng: random.Random, n: int, exclude: set[str]) -> list[dict]:
    tasks = new_tasks(rng, exclude)
    return [{"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}
            for prompt, answer in (next(tasks) for _ in range(n))]


FILLERS = [("well, i think it is ", ""), ("hmm, maybe ", ""), ("", ", i guess"), ("so the answer is ", " ok")]


def make_preferences(rng: random.Random, n: int, exclude: set[str]) -> list[dict]:
    """{prompt, chosen, rejected}: the prompt as a conversation, the replies as text."""
    rows, tasks = [], new_tasks(rng, exclude)
    while len(rows) < n:
        prompt, answer = next(tasks)
        before, after = rng.choice(FILLERS)
        rows.append({"prompt": [{"role": "user", "content": prompt}], "chosen": answer,
                     "rejected": before + answer + after})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def train_tokenizer(texts: list[str], out: Path) -> None:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        additional_special_tokens=SPECIAL[2:],
        model_max_length=256,
    )
    fast.save_pretrained(out)


def main() -> None:
    rng = random.Random(1234)
    eval_rows = make_split(rng, 300, set())
    train_rows = make_split(rng, 4000, {r["messages"][0]["content"] for r in eval_rows})
    write_jsonl(HERE / "data" / "tasks-train.jsonl", train_rows)
    write_jsonl(HERE / "data" / "tasks-eval.jsonl", eval_rows)
    texts = [m["content"] for r in train_rows for m in r["messages"]]
    train_tokenizer(texts, HERE / "tiny" / "tokenizer")
    rng = random.Random(4321)  # its own stream: the files above stay as they were
    eval_prefs = make_preferences(rng, 100, set())
    train_prefs = make_preferences(rng, 1000, {r["prompt"][0]["content"] for r in eval_prefs})
    write_jsonl(HERE / "data" / "prefs-train.jsonl", train_prefs)
    write_jsonl(HERE / "data" / "prefs-eval.jsonl", eval_prefs)
    print(f"wrote {len(train_rows)} train and {len(eval_rows)} eval tasks, {len(train_prefs)} train and "
          f"{len(eval_prefs)} eval preference pairs, and the tokenizer under {HERE.name}/")


if __name__ == "__main__":
    main()
