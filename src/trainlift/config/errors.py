"""One line for the first problem pydantic found in a spec, starting with its field path (`workers[0].gpus`)."""

from __future__ import annotations

import difflib
import typing
from typing import Any

from pydantic import ValidationError


def field_path(parts: tuple[Any, ...]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def first_error(exc: ValidationError) -> str:
    errors = exc.errors()
    err = errors[0]
    loc = field_path(err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    elif err["type"] == "missing":
        msg = "required key is missing"
    elif "input" in err and not isinstance(err["input"], dict) and "(got " not in msg:
        msg = f"{msg} (got {err['input']!r})"
    line = f"{loc}: {msg}" if loc else msg
    return line + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else "")


def unknown_key_suggestion(model: type, exc: ValidationError) -> str:
    """' (did you mean train.steps?)' for a first error that is an unknown key close to a field of its section."""
    err = exc.errors()[0]
    if err["type"] != "extra_forbidden":
        return ""
    *sections, key = err["loc"]
    for part in sections:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        models = [t for t in (getattr(field, "annotation", None), *typing.get_args(getattr(field, "annotation", None)))
                  if isinstance(t, type) and hasattr(t, "model_fields")]
        if not models:
            return ""
        model = models[0]
    close = difflib.get_close_matches(str(key), list(model.model_fields), n=1)
    return f" (did you mean {field_path((*sections, close[0]))}?)" if close else ""
