"""Row formats (`data.format`), and the mapping of each onto what the tokenizer reads.

  messages           {"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}]}
  alpaca             {"instruction": ..., "input": ... (optional), "output": ..., "system": ... (optional)}
                     -> messages: [system], user = instruction + "\\n\\n" + input (when not empty), assistant = output
  sharegpt           {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}], "system": (optional)}
                     -> messages, roles mapped by SHAREGPT_ROLES
  prompt_completion  {"prompt": ..., "completion": ...}
  text               {"text": ...}
  preference         {"prompt": ..., "chosen": ..., "rejected": ...}: checked and passed on unchanged, for
                     preference training; next-token fine-tuning does not read them
  auto               the one format whose keys the source's first row has (after `data.columns` renames)

The mapping happens before tokenization: everything downstream sees messages, prompt_completion, text or
preference rows.
"""

from __future__ import annotations

import json
from typing import Any

from trainlift.errors import UsageError

FORMAT_KEYS = {"messages": ("messages",), "alpaca": ("instruction", "output"), "sharegpt": ("conversations",),
               "prompt_completion": ("prompt", "completion"), "text": ("text",),
               "preference": ("prompt", "chosen", "rejected")}
# Every key a format reads: what `data.columns` may rename.
COLUMN_KEYS = ("messages", "prompt", "completion", "text", "instruction", "input", "output", "system",
               "conversations", "chosen", "rejected")
MAPPED_TO = {"alpaca": "messages", "sharegpt": "messages"}  # the others reach the tokenizer as they are
# ShareGPT speakers: a function call is the assistant's turn (trained); its result is the tool's (not trained).
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "function_call": "assistant", "system": "system",
                  "tool": "tool", "observation": "tool"}


def tokenized_as(fmt: str) -> str:
    """The format a row of `fmt` has once mapped: what the tokenizer reads."""
    return MAPPED_TO.get(fmt, fmt)


def detect(keys: list[str], field: str) -> str:
    """The one format whose keys are all among `keys`; otherwise one line naming the keys and every format's."""
    fits = [fmt for fmt, need in FORMAT_KEYS.items() if set(need) <= set(keys)]
    if len(fits) == 1:
        return fits[0]
    needs = "; ".join(f"{fmt} needs {', '.join(need)}" for fmt, need in FORMAT_KEYS.items())
    both = f"{', '.join(fits[:-1])} and {fits[-1]} {'both' if len(fits) == 2 else 'all'} fit; " if fits else ""
    fix = f"set {field}.format" if field.endswith("]") else "set data.format"
    raise UsageError(f"{field}: cannot tell the row format from the columns {', '.join(keys) or '(none)'} "
                     f"({both}{needs}): {fix}")


def mapped(row: dict, fmt: str, where: str) -> dict:
    """The row in the format it is tokenized as, checked."""
    listed = {"messages": "messages", "sharegpt": "conversations"}.get(fmt)
    if listed and isinstance(row.get(listed), str):
        try:  # a CSV cell holds a conversation as JSON text
            row = {**row, listed: json.loads(row[listed])}
        except json.JSONDecodeError as exc:
            raise UsageError(f"{where}: {listed} is not valid JSON ({exc.msg})") from None
    missing = [key for key in FORMAT_KEYS[fmt] if key not in row]
    if missing:
        raise UsageError(f"{where}: missing {', '.join(missing)} for data.format={fmt}")
    if fmt == "alpaca":
        row = {"messages": alpaca_messages(row, where)}
    elif fmt == "sharegpt":
        row = {"messages": sharegpt_messages(row, where)}
    check_row(row, tokenized_as(fmt), where)
    return row


def _text(row: dict, key: str, where: str, optional: bool = False) -> str:
    value = row.get(key)
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        raise UsageError(f"{where}: {key} must be text (got {type(value).__name__})")
    return value


def alpaca_messages(row: dict, where: str) -> list[dict]:
    instruction, extra = _text(row, "instruction", where), _text(row, "input", where, optional=True)
    system = _text(row, "system", where, optional=True)
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": instruction + (f"\n\n{extra}" if extra else "")},
                       {"role": "assistant", "content": _text(row, "output", where)}]


def sharegpt_messages(row: dict, where: str) -> list[dict]:
    turns = row.get("conversations")
    if not isinstance(turns, list):
        raise UsageError(f"{where}: conversations must be a list of {{from, value}} objects")
    system = _text(row, "system", where, optional=True)
    messages = [{"role": "system", "content": system}] if system else []
    for i, turn in enumerate(turns):
        speaker = turn.get("from", turn.get("role")) if isinstance(turn, dict) else None
        content = turn.get("value", turn.get("content")) if isinstance(turn, dict) else None
        if not isinstance(content, str):
            raise UsageError(f"{where}: conversations[{i}] must be a {{from, value}} object with text value")
        if speaker not in SHAREGPT_ROLES:
            raise UsageError(f"{where}: conversations[{i}].from is {speaker!r}; the speakers are "
                             f"{', '.join(SHAREGPT_ROLES)}")
        messages.append({"role": SHAREGPT_ROLES[speaker], "content": content})
    return messages


def check_row(row: Any, fmt: str, where: str) -> None:
    """A row in a tokenized format (messages, prompt_completion, text, preference) has what that format reads."""
    need = FORMAT_KEYS[fmt]
    missing = [k for k in need if not isinstance(row, dict) or k not in row]
    if missing:
        raise UsageError(f"{where}: missing {', '.join(missing)!s} for data.format={fmt}")
    if fmt == "preference":
        return  # read by the preference trainer, which checks what chosen and rejected hold
    if fmt != "messages":
        for key in need:
            if not isinstance(row[key], str):
                raise UsageError(f"{where}: {key} must be text (got {type(row[key]).__name__})")
        return
    msgs = row["messages"]
    if not isinstance(msgs, list) or not all(
            isinstance(m, dict) and {"role", "content"} <= m.keys() and isinstance(m["content"], str) for m in msgs):
        raise UsageError(f"{where}: messages must be a list of {{role, content}} objects with text content")
    if not any(m["role"] == "assistant" for m in msgs):
        raise UsageError(f"{where}: no assistant message to learn from")
