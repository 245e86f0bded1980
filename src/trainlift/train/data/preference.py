"""Preference pairs for DPO (`data.format: preference`): check, tokenize, pack.

A row is {"prompt", "chosen", "rejected"}:
  prompt             text, or a conversation (a list of {role, content} messages) the reply answers
  chosen, rejected   the assistant's reply as text, or as messages: the reply's turns alone, or the whole
                     conversation (the prompt's messages, then the reply ending in the assistant's turn)

Each row becomes two examples, chosen then rejected, tokenized like prompt_completion (text prompts) or messages
(conversations, through the tokenizer's chat template when it has one, examples.py's segments): the prompt is
masked, the reply trained. A conversation's earlier assistant turns are part of the prompt, so masked too.

Packing keeps a pair in one row (chosen, rejected, chosen, rejected, ...); position ids restart at each example
as in examples.py, so the examples of a row are found again from them (`example_layout`). A pair longer than
`seq_len` is cut to fit, each example keeping its start, and counted as truncated.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from trainlift.errors import UsageError
from trainlift.train.data import examples as data, formats, source as datasource
from trainlift.train.data.mixture import Mixture

FORMAT = "preference"
KEYS = ("prompt", "chosen", "rejected")
Pair = tuple[data.Example, data.Example]


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and {"role", "content"} <= m.keys() and isinstance(m["content"], str) for m in value)


def check_row(row: Any, where: str) -> None:
    """One line naming `where` (file:row) for the first thing wrong with a preference row."""
    missing = [k for k in KEYS if not isinstance(row, dict) or k not in row]
    if missing:
        raise UsageError(f"{where}: missing {', '.join(missing)} for data.format={FORMAT}")
    if not (isinstance(row["prompt"], str) or _is_messages(row["prompt"])):
        raise UsageError(f"{where}: prompt must be text or a list of {{role, content}} messages "
                         f"(got {type(row['prompt']).__name__})")
    for key in ("chosen", "rejected"):
        reply = row[key]
        if isinstance(reply, str):
            continue
        if not _is_messages(reply):
            raise UsageError(f"{where}: {key} must be text or a list of {{role, content}} messages "
                             f"(got {type(reply).__name__})")
        if reply[-1]["role"] != "assistant":
            raise UsageError(f"{where}: {key} must end with the assistant's turn (its last role is "
                             f"{reply[-1]['role']})")
        if not reply_turns(as_messages(row["prompt"]), reply):
            raise UsageError(f"{where}: {key} repeats the prompt but holds no reply after it")


def as_messages(prompt: str | list[dict]) -> list[dict]:
    return prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


def reply_turns(prompt: list[dict], reply: list[dict]) -> list[dict]:
    """The reply's own turns: a reply that starts with the prompt's messages has them left out."""
    return reply[len(prompt):] if reply[:len(prompt)] == prompt else reply


def checked_rows(rows: Iterable[tuple[str, dict]], sources: Sequence[datasource.SourceSpec]) -> Iterator[dict]:
    """The preference rows of a split's stream of (format, row) (a `Mixture`, which drew them from `sources`).
    The stream does not say where a row came from; at the first one that is not a sound preference row, the
    sources are read again to name it (`refuse_bad_rows`)."""
    for fmt, row in rows:
        try:
            if fmt != FORMAT:
                raise UsageError(f"train.objective: dpo learns from preference rows (prompt, chosen, rejected), not "
                                 f"{fmt} rows")
            check_row(row, "a drawn row")
        except UsageError:
            refuse_bad_rows(sources)  # names the row, unless the sources changed since it was drawn
            raise
        yield row


def refuse_bad_rows(sources: Sequence[datasource.SourceSpec]) -> None:
    """One line for the first source whose rows are not preference rows, else for the first bad row, by file:row."""
    for source in sources:
        for _, row in datasource.rows_of(source):  # its first row settles its format
            fmt = source.fmt
            if fmt == "auto" and isinstance(row, dict):
                fmt = formats.detect(list(datasource.rename(row, dict(source.columns))), source.field)
            if fmt != FORMAT:
                raise UsageError(f"{source.field}: train.objective: dpo learns from preference rows (prompt, chosen, "
                                 f"rejected), but {source.location} holds {fmt} rows",
                                 hint="give preference rows, or name their columns with data.columns")
            break
    for source in sources:
        for where, row in datasource.rows_of(source):
            check_row(datasource.rename(row, dict(source.columns)), where)


def segments_of_reply(row: dict, key: str, tokenizer) -> tuple[list[tuple[str, bool]], bool]:
    """The text of the prompt and one reply in pieces, each marked trained or not, and whether it is a chat
    rendering (examples.py's rule for a leading BOS)."""
    prompt, reply = row["prompt"], row[key]
    if isinstance(prompt, str) and isinstance(reply, str):
        return data.segments_of({"prompt": prompt, "completion": reply}, "prompt_completion", tokenizer), False
    context = as_messages(prompt)
    turns = [{"role": "assistant", "content": reply}] if isinstance(reply, str) else reply_turns(context, reply)
    segments = data.segments_of({"messages": context + turns}, "messages", tokenizer)
    earlier = sum(m["role"] == "assistant" for m in context)  # assistant turns of the prompt: not trained
    marked, seen = [], 0
    for text, trained in segments:
        seen += trained
        marked.append((text, trained and seen > earlier))
    return marked, True


def to_pairs(rows: list[dict], tokenizer) -> list[Pair]:
    """(chosen, rejected) examples of each row; every piece of text goes to the tokenizer in one batch call."""
    rendered = [segments_of_reply(row, key, tokenizer) for row in rows for key in ("chosen", "rejected")]
    texts = [text for segments, _ in rendered for text, _ in segments]
    pieces = iter(tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
    examples = []
    for segments, chat in rendered:
        with_bos = tokenizer.bos_token_id is not None and not (chat and tokenizer.chat_template)
        ids, labels = ([tokenizer.bos_token_id], [data.IGNORE]) if with_bos else ([], [])
        for _, trained in segments:
            piece = next(pieces)
            ids += piece
            labels += piece if trained else [data.IGNORE] * len(piece)
        examples.append(data.Example(ids, labels))
    return list(zip(examples[0::2], examples[1::2]))


def pairs_of(rows: Iterable[dict], tokenizer, batch: int = 512) -> Iterator[Pair]:
    """`to_pairs` over a stream of rows, `batch` rows at a time."""
    chunk: list[dict] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == batch:
            yield from to_pairs(chunk, tokenizer)
            chunk = []
    if chunk:
        yield from to_pairs(chunk, tokenizer)


def fit_pair(chosen: data.Example, rejected: data.Example, seq_len: int) -> tuple[data.Example, data.Example, int]:
    """The pair cut to fit one row of `seq_len` (each keeps at least half of it, or all it has), and how many of
    the two were cut."""
    if len(chosen.input_ids) + len(rejected.input_ids) <= seq_len:
        return chosen, rejected, 0
    keep_chosen = min(len(chosen.input_ids), max(seq_len // 2, seq_len - len(rejected.input_ids)))
    keep_rejected = min(len(rejected.input_ids), seq_len - keep_chosen)
    cut = [data.Example(e.input_ids[:k], e.labels[:k]) for e, k in ((chosen, keep_chosen), (rejected, keep_rejected))]
    return cut[0], cut[1], int(keep_chosen < len(chosen.input_ids)) + int(keep_rejected < len(rejected.input_ids))


def pack_pairs(pairs: Iterable[Pair], seq_len: int, pad_id: int) -> Iterator[tuple[dict, list[int], int]]:
    """Greedy in-order packing of whole pairs, as `examples.pack_stream` packs examples: yields (row, indices of
    its examples, how many of them were cut). Pair i is examples 2i (chosen) and 2i + 1 (rejected)."""
    row: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": []}
    members: list[int] = []
    truncated = 0
    for i, pair in enumerate(pairs):
        chosen, rejected, cut = fit_pair(*pair, seq_len)
        if members and len(row["input_ids"]) + len(chosen.input_ids) + len(rejected.input_ids) > seq_len:
            yield _closed(row, seq_len, pad_id), members, truncated
            row, members, truncated = {"input_ids": [], "labels": [], "position_ids": []}, [], 0
        for index, example in ((2 * i, chosen), (2 * i + 1, rejected)):
            row["input_ids"] += example.input_ids
            row["labels"] += [data.IGNORE] + example.labels[1:]  # nothing predicts an example's first token
            row["position_ids"] += list(range(len(example.input_ids)))
            members.append(index)
        truncated += cut
    if members:
        yield _closed(row, seq_len, pad_id), members, truncated


def _closed(row: dict[str, list[int]], seq_len: int, pad_id: int) -> dict:
    pad = seq_len - len(row["input_ids"])
    return {"input_ids": row["input_ids"] + [pad_id] * pad, "labels": row["labels"] + [data.IGNORE] * pad,
            "position_ids": row["position_ids"] + list(range(pad)), "num_tokens": len(row["input_ids"])}


def packed_rows(mixture: Mixture, tokenizer, seq_len: int) -> Iterator[tuple[dict, list[int], int]]:
    """Every pair a split's `mixture` draws, checked, tokenized and packed: `pack_pairs`'s rows."""
    pairs = pairs_of(checked_rows(mixture, mixture.sources), tokenizer)
    return pack_pairs(pairs, seq_len, data.pad_id_of(tokenizer))


def prepare(data_spec: Any, tokenizer, seq_len: int, columns: dict[str, str] | None = None,
            limit: int | None = None, seed: int = 0) -> data.Packed:
    """`packed_rows` of a data value held in memory, as `examples.prepare` holds SFT rows."""
    rows, members, truncated = [], [], 0
    mixture = data.mixture(data_spec, FORMAT, columns, limit, seed=seed)
    for row, row_members, row_truncated in packed_rows(mixture, tokenizer, seq_len):
        rows.append(row)
        members.append(row_members)
        truncated += row_truncated
    return data.Packed(rows, members, truncated, sum(r["num_tokens"] for r in rows))


def example_layout(rows: Sequence[dict]) -> tuple[np.ndarray, np.ndarray]:
    """For packed preference rows as a micro-batch: [rows, seq_len] the index of each real token's example among
    the batch's examples (row by row, so chosen ones are even and rejected ones odd), IGNORE for padding; and
    each example's trained-token count. Examples start where position ids restart before a row's `num_tokens`."""
    positions = np.stack([np.asarray(r["position_ids"]) for r in rows])
    labels = np.stack([np.asarray(r["labels"]) for r in rows])
    real = np.arange(positions.shape[1]) < np.asarray([[r.get("num_tokens", positions.shape[1])] for r in rows])
    starts = (positions == 0) & real
    owner = np.where(real, np.cumsum(starts.ravel()).reshape(starts.shape) - 1, data.IGNORE).astype(np.int64)
    trained = (labels[:, 1:] != data.IGNORE) & (owner[:, 1:] >= 0)
    counts = np.bincount(owner[:, 1:][trained], minlength=int(starts.sum())).astype(np.int64)
    return owner, counts
