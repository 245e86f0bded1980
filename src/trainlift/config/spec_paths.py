"""The local paths of a job spec file: relative ones are taken from the spec's directory, so a spec reads the same
from any directory; a hub id is left as it is. Pure: no model or data is read."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def not_a_hub_id(value: str) -> bool:
    """A hub id is `name` or `owner/name`: `./x`, `../x`, `~/x` and `a/b/c` can only be local paths."""
    return value.startswith((".", "/", "~")) or value.count("/") > 1


def relative_to_spec(raw: dict[str, Any], spec_dir: Path) -> dict[str, Any]:
    """The spec file's relative local paths made relative to its directory (the spec reads the same from any
    directory): data sources (the `source` of each mapping too; hf:// and s3:// are no paths) and run.storage
    always; model.path, model.tokenizer and a model.config file name when that path exists there (else it is a hub
    id), model.path also when model.config builds the model there."""
    def under(value: Any) -> Any:
        if not isinstance(value, str) or "://" in value or Path(value).expanduser().is_absolute():
            return value
        return str(spec_dir / value)

    def under_if_there(value: Any) -> Any:
        moved = under(value)
        return moved if moved is not value and (Path(moved).exists() or not_a_hub_id(value)) else value

    def sources_under(value: Any) -> Any:  # a location, a {source: ...} mapping, or a list of them
        if isinstance(value, list):
            return [sources_under(entry) for entry in value]
        if isinstance(value, dict) and "source" in value:
            return {**value, "source": under(value["source"])}
        return under(value)

    model, data, run = (raw.get(key) if isinstance(raw.get(key), dict) else {} for key in ("model", "data", "run"))
    for key in ("train", "eval"):
        if key in data:
            data[key] = sources_under(data[key])
    if "storage" in run:
        run["storage"] = under(run["storage"])
    builds_here = isinstance(model.get("config"), dict)
    for key in ("path", "tokenizer", "config"):
        if key in model:
            model[key] = under(model[key]) if key == "path" and builds_here else under_if_there(model[key])
    return raw
