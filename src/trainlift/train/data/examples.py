"""Read, format, tokenize, mask, pack and shard the training data.

Rows come from files or `datasets` sources (source.py, hub.py), several of them mixed by weight (mixture.py),
in a format (formats.py: alpaca and sharegpt rows become messages) that reaches the tokenizer as one of:
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

import functools
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

import numpy as np

from trainlift.errors import UsageError
from trainlift.train.data import source as datasource
from trainlift.train.data.formats import check_row
from trainlift.train.data.mixture import Mixture

if TYPE_CHECKING:
    import torch

IGNORE = -100


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]


@dataclass
class Packed:
    rows: Sequence[dict]  # a list here; rows mapped from the data cache in datacache.py
    examples_per_row: Sequence[list[int]]
    truncated: int = 0
    tokens: int = field(default=0)


def read_jsonl(path: str | Path, fmt: str, field: str = "--data") -> list[dict[str, Any]]:
    """Every row of a JSONL file (or a directory of them, or s3://), each checked; errors name file:line."""
    rows = []
    for where, row in datasource.iter_rows(datasource.resolve(str(path), field)):
        check_row(row, fmt, where)
        rows.append(row)
    if not rows:
        raise UsageError(f"{path}: no examples in the file")
    return rows


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
    segments = _simple_chat_segments(messages, tokenizer.eos_token or "")  # earlier answers end as training ends them
    return "".join(text for text, _ in segments) + "<|assistant|>\n"


def segments_of(row: dict, fmt: str, tokenizer) -> list[tuple[str, bool]]:
    """The row's text in pieces, each marked trained or not."""
    eos = tokenizer.eos_token or ""
    if fmt == "messages":
        if tokenizer.chat_template:
            return _template_chat_segments(row["messages"], tokenizer)
        return _simple_chat_segments(row["messages"], eos)
    if fmt == "prompt_completion":
        return [(row["prompt"], False), (row["completion"] + eos, True)]
    if fmt == "preference":
        raise UsageError("data.format=preference: prompt, chosen and rejected rows train with a preference "
                         "objective, not next-token fine-tuning",
                         hint="give messages, alpaca, sharegpt, prompt_completion or text rows")
    return [(row["text"] + eos, True)]


def starts_with_bos(tokenizer, fmt: str) -> bool:
    """Whether an example of `fmt` starts with the BOS token: always where the tokenizer has one, except for
    messages its chat template lays out (the template writes its own)."""
    return tokenizer.bos_token_id is not None and not (fmt == "messages" and tokenizer.chat_template)


def to_examples(rows: list[dict], fmt: str | Sequence[str], tokenizer) -> list[Example]:
    """Tokenized, masked examples; every segment of every row goes to the tokenizer in one batch call. `fmt`: the
    rows' format, or each row's (as tokenized: messages, prompt_completion or text)."""
    fmts = [fmt] * len(rows) if isinstance(fmt, str) else list(fmt)
    segments = [segments_of(row, row_fmt, tokenizer) for row, row_fmt in zip(rows, fmts)]
    texts = [text for row_segments in segments for text, _ in row_segments]
    pieces = iter(tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
    examples = []
    for row_segments, row_fmt in zip(segments, fmts):
        ids, labels = ([tokenizer.bos_token_id], [IGNORE]) if starts_with_bos(tokenizer, row_fmt) else ([], [])
        for _, trained in row_segments:
            piece = next(pieces)
            ids += piece
            labels += piece if trained else [IGNORE] * len(piece)
        examples.append(Example(ids, labels))
    return examples


def to_example(row: dict, fmt: str, tokenizer) -> Example:
    return to_examples([row], fmt, tokenizer)[0]


def examples_of(rows: Iterable[dict], fmt: str, tokenizer, batch: int = 1024) -> Iterator[Example]:
    """`to_examples` over a stream of rows, `batch` rows at a time."""
    return typed_examples(((fmt, row) for row in rows), tokenizer, batch)


def typed_examples(typed_rows: Iterable[tuple[str, dict]], tokenizer, batch: int = 1024) -> Iterator[Example]:
    """`to_examples` over a stream of (format, row), as a `Mixture` yields them, `batch` rows at a time."""
    chunk: list[tuple[str, dict]] = []
    for item in typed_rows:
        chunk.append(item)
        if len(chunk) == batch:
            yield from to_examples([row for _, row in chunk], [fmt for fmt, _ in chunk], tokenizer)
            chunk = []
    if chunk:
        yield from to_examples([row for _, row in chunk], [fmt for fmt, _ in chunk], tokenizer)


def pack_stream(examples: Iterable[Example], seq_len: int, pad_id: int) -> Iterator[tuple[dict, list[int], int]]:
    """Greedy in-order packing: each example goes whole into the current row or starts a new one.
    Yields (row, indices of its examples, how many of them were truncated to `seq_len`)."""
    cur = {"input_ids": [], "labels": [], "position_ids": []}
    cur_members: list[int] = []
    cur_truncated = 0

    def close():
        pad = seq_len - len(cur["input_ids"])
        return ({
            "input_ids": cur["input_ids"] + [pad_id] * pad,
            "labels": cur["labels"] + [IGNORE] * pad,
            "position_ids": cur["position_ids"] + list(range(pad)),
            "num_tokens": len(cur["input_ids"]),
        }, list(cur_members), cur_truncated)

    for idx, ex in enumerate(examples):
        ids, labels, truncated = ex.input_ids, ex.labels, 0
        if len(ids) > seq_len:
            ids, labels, truncated = ids[:seq_len], labels[:seq_len], 1
        if cur_members and len(cur["input_ids"]) + len(ids) > seq_len:
            yield close()
            cur = {"input_ids": [], "labels": [], "position_ids": []}
            cur_members, cur_truncated = [], 0
        cur["input_ids"] += ids
        # nothing predicts an example's first token from the previous one
        cur["labels"] += [IGNORE] + labels[1:] if labels else []
        cur["position_ids"] += list(range(len(ids)))
        cur_members.append(idx)
        cur_truncated += truncated
    if cur_members:
        yield close()


def pack(examples: Iterable[Example], seq_len: int, pad_id: int) -> Packed:
    rows, members, truncated = [], [], 0
    for row, row_members, row_truncated in pack_stream(examples, seq_len, pad_id):
        rows.append(row)
        members.append(row_members)
        truncated += row_truncated
    return Packed(rows, members, truncated, sum(r["num_tokens"] for r in rows))


def mixture(data_spec: Any, fmt: str = "auto", columns: dict[str, str] | None = None, limit: int | None = None,
            field: str = "data.train", seed: int = 0, size: int | None = None) -> Mixture:
    """The example stream of a `data.train`/`data.eval` value (a location, a source mapping, or a list to mix);
    `fmt` and `columns` are the defaults of sources that set none; see mixture.py for `seed` and `size`."""
    return Mixture(datasource.specs_of(data_spec, fmt, columns, field), seed, size, limit)


def records(data_spec: Any, fmt: str = "auto", columns: dict[str, str] | None = None, limit: int | None = None,
            field: str = "data.train", seed: int = 0, size: int | None = None) -> Iterator[dict]:
    """Checked rows of a data value, each in the format it is tokenized as; errors name file:row."""
    return (row for _, row in mixture(data_spec, fmt, columns, limit, field, seed, size))


def pad_id_of(tokenizer) -> int:
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return pad_id or 0


def prepare(data_spec: Any, fmt: str, tokenizer, seq_len: int, columns: dict[str, str] | None = None,
            limit: int | None = None, seed: int = 0, size: int | None = None) -> Packed:
    """Every example of a data value (at most `limit`), tokenized and packed, held in memory."""
    stream = mixture(data_spec, fmt, columns, limit, seed=seed, size=size)
    return pack(typed_examples(stream, tokenizer), seq_len, pad_id_of(tokenizer))


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n))
    random.Random(seed * 100_003 + epoch).shuffle(order)
    return order


@functools.lru_cache(maxsize=2)
def _epoch_order_array(n: int, seed: int, epoch: int) -> np.ndarray:
    """One epoch's order, shuffled once rather than at every step, and kept as an array, not a list of ints."""
    order = np.asarray(epoch_order(n, seed, epoch), dtype=np.int64)
    order.flags.writeable = False
    return order


def global_indices(n: int, seed: int, cursor: int, count: int) -> list[int]:
    """Pack indices cursor..cursor+count-1 of the endless, per-epoch shuffled stream."""
    out = []
    for pos in range(cursor, cursor + count):
        epoch, i = divmod(pos, n)
        out.append(int(_epoch_order_array(n, seed, epoch)[i]))
    return out


def rank_slice(indices: list[int], rank: int, world: int) -> list[int]:
    """Contiguous, disjoint slice of a global micro-batch for one worker."""
    per = len(indices) // world
    return indices[rank * per:(rank + 1) * per]


def collate(rows: list[dict]) -> dict:
    """Tensors for the model plus two counts, taken here on the host so the training step need not read them back
    from the device: `num_tokens`, real (non-padding) tokens, and `trainable_tokens`, tokens whose next-token
    label is trained on."""
    import torch  # here, not at import: the driver builds the data cache without torch

    arrays = {k: np.stack([np.asarray(r[k]) for r in rows]) for k in ("input_ids", "labels", "position_ids")}
    batch = {k: torch.from_numpy(a).long() for k, a in arrays.items()}
    batch["num_tokens"] = int(sum(r.get("num_tokens", len(r["input_ids"])) for r in rows))
    batch["trainable_tokens"] = int((arrays["labels"][:, 1:] != IGNORE).sum())
    # Padding restarts its positions too; it is no example, and its tokens are not counted.
    batch["attended_pairs"] = sum(attended_pairs(row[:r.get("num_tokens", len(row))])
                                  for row, r in zip(arrays["position_ids"], rows))
    return batch


def attended_pairs(position_ids: np.ndarray) -> int:
    """Σ s² over the packed examples of a row (each starts at position 0): a token of an example of length s
    attends to s positions, so this over the tokens is the row's mean attended length, for FLOPs."""
    starts = np.flatnonzero(position_ids == 0)
    if not starts.size or starts[0] != 0:
        starts = np.concatenate([[0], starts])
    lengths = np.diff(np.append(starts, len(position_ids)))
    return int((lengths ** 2).sum())


def worker_row_batches(rows: int, rank: int, world: int, micro_batch: int) -> list[list[int]]:
    """This worker's row indices of an evaluated (or scored) split, `micro_batch` at a time; every worker gets as
    many batches (an empty one where it has run out), because FSDP needs all workers in every forward."""
    mine = list(range(rank, rows, world))
    batches = -(-len(range(0, rows, world)) // micro_batch)
    return [mine[i * micro_batch:(i + 1) * micro_batch] for i in range(batches)]
