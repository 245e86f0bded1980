"""Read, format, tokenize, mask, pack and shard the training data.

Formats (one JSON object per line):
  messages           {"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}]}
  prompt_completion  {"prompt": ..., "completion": ...}
  text               {"text": ...}

Chat rows use the tokenizer's chat template when it has one. Otherwise this
simple template, where only the assistant's content and the EOS are trained:

  <|user|>\\n{content}\\n<|assistant|>\\n{content}<EOS>

Examples are packed whole into rows of `seq_len` (never split; one longer than
`seq_len` is truncated and counted), padded, with position ids restarting at
each example (transformers turns restarting position ids into a block-diagonal
attention mask, so packed examples do not attend to each other). The order of packs is a pure function of (seed, epoch), so a
global cursor — how many packs have been consumed — is the whole data position.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainlift.errors import UsageError

IGNORE = -100
REQUIRED_KEYS = {"messages": ("messages",), "prompt_completion": ("prompt", "completion"), "text": ("text",)}


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]


@dataclass
class Packed:
    rows: list[dict]
    examples_per_row: list[list[int]]
    truncated: int = 0
    tokens: int = field(default=0)


def read_jsonl(path: str | Path, fmt: str) -> list[dict[str, Any]]:
    """Parse and check every line; errors name file:line."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: data file not found", hint="check data.train / data.eval")
    rows = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            check_row(row, fmt, f"{path}:{lineno}")
            rows.append(row)
    if not rows:
        raise UsageError(f"{path}: no examples in the file")
    return rows


def check_row(row: Any, fmt: str, where: str) -> None:
    missing = [k for k in REQUIRED_KEYS[fmt] if not isinstance(row, dict) or k not in row]
    if missing:
        raise UsageError(f"{where}: missing {', '.join(missing)!s} for data.format={fmt}")
    if fmt == "messages":
        msgs = row["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in msgs):
            raise UsageError(f"{where}: messages must be a list of {{role, content}} objects")
        if not any(m["role"] == "assistant" for m in msgs):
            raise UsageError(f"{where}: no assistant message to learn from")


def _simple_chat_segments(messages: list[dict], eos: str) -> list[tuple[str, bool]]:
    segments = []
    for msg in messages:
        if msg["role"] == "assistant":
            segments += [("<|assistant|>\n", False), (msg["content"] + eos, True)]
        else:
            segments.append((f"<|{msg['role']}|>\n{msg['content']}\n", False))
    return segments


def _template_chat_segments(messages: list[dict], tokenizer) -> list[tuple[str, bool]]:
    def render(msgs, gen):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    segments, done = [], ""
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        prompt, full = render(messages[:i], True), render(messages[: i + 1], False)
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise UsageError("the tokenizer's chat template does not render conversations prefix by prefix; "
                             "use data.format=prompt_completion")
        segments += [(prompt[len(done):], False), (full[len(prompt):], True)]
        done = full
    return segments


def chat_prompt(messages: list[dict], tokenizer) -> str:
    """The text a model is given to answer the last user turn."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(text for text, _ in _simple_chat_segments(messages, "")) + "<|assistant|>\n"


def to_example(row: dict, fmt: str, tokenizer) -> Example:
    eos = tokenizer.eos_token or ""
    if fmt == "messages":
        if tokenizer.chat_template:
            segments = _template_chat_segments(row["messages"], tokenizer)
        else:
            segments = _simple_chat_segments(row["messages"], eos)
    elif fmt == "prompt_completion":
        segments = [(row["prompt"], False), (row["completion"] + eos, True)]
    else:
        segments = [(row["text"] + eos, True)]
    ids, labels = [], []
    if tokenizer.bos_token_id is not None and not (fmt == "messages" and tokenizer.chat_template):
        ids, labels = [tokenizer.bos_token_id], [IGNORE]
    for text, trained in segments:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if trained else [IGNORE] * len(piece)
    return Example(ids, labels)


def pack(examples: list[Example], seq_len: int, pad_id: int) -> Packed:
    """Greedy in-order packing: each example goes whole into the current row or starts a new one."""
    rows, members, truncated, tokens = [], [], 0, 0
    cur = {"input_ids": [], "labels": [], "position_ids": []}
    cur_members: list[int] = []

    def close():
        pad = seq_len - len(cur["input_ids"])
        rows.append({
            "input_ids": cur["input_ids"] + [pad_id] * pad,
            "labels": cur["labels"] + [IGNORE] * pad,
            "position_ids": cur["position_ids"] + list(range(pad)),
            "num_tokens": len(cur["input_ids"]),
        })
        members.append(list(cur_members))

    for idx, ex in enumerate(examples):
        ids, labels = ex.input_ids, ex.labels
        if len(ids) > seq_len:
            ids, labels, truncated = ids[:seq_len], labels[:seq_len], truncated + 1
        if cur_members and len(cur["input_ids"]) + len(ids) > seq_len:
            close()
            cur = {"input_ids": [], "labels": [], "position_ids": []}
            cur_members = []
        cur["input_ids"] += ids
        cur["labels"] += [IGNORE] + labels[1:]  # nothing predicts an example's first token from the previous one
        cur["position_ids"] += list(range(len(ids)))
        cur_members.append(idx)
        tokens += len(ids)
    if cur_members:
        close()
    return Packed(rows, members, truncated, tokens)


def prepare(path: str, fmt: str, tokenizer, seq_len: int) -> Packed:
    rows = read_jsonl(path, fmt)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return pack([to_example(r, fmt, tokenizer) for r in rows], seq_len, pad_id or 0)


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n))
    random.Random(seed * 100_003 + epoch).shuffle(order)
    return order


def global_indices(n: int, seed: int, cursor: int, count: int) -> list[int]:
    """Pack indices cursor..cursor+count-1 of the endless, per-epoch shuffled stream."""
    out, orders = [], {}
    for pos in range(cursor, cursor + count):
        epoch, i = divmod(pos, n)
        if epoch not in orders:
            orders[epoch] = epoch_order(n, seed, epoch)
        out.append(orders[epoch][i])
    return out


def rank_slice(indices: list[int], rank: int, world: int) -> list[int]:
    """Contiguous, disjoint slice of a global micro-batch for one worker."""
    per = len(indices) // world
    return indices[rank * per:(rank + 1) * per]


def collate(rows: list[dict]) -> dict:
    """Tensors for the model plus `num_tokens`, the count of real (non-padding) tokens."""
    batch = {k: torch.tensor([r[k] for r in rows], dtype=torch.long) for k in ("input_ids", "labels", "position_ids")}
    batch["num_tokens"] = sum(r.get("num_tokens", len(r["input_ids"])) for r in rows)
    return batch


def eval_batches(packed: Packed, rank: int, world: int, micro_batch: int) -> list[dict[str, torch.Tensor] | None]:
    """This worker's eval rows in batches; every worker gets the same number (None for a missing one),
    because FSDP needs all workers in every forward."""
    mine = packed.rows[rank::world]
    n_batches = -(-len(packed.rows[0::world]) // micro_batch)
    return [collate(mine[i * micro_batch:(i + 1) * micro_batch]) if mine[i * micro_batch:(i + 1) * micro_batch]
            else None for i in range(n_batches)]
