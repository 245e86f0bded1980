"""<run>/spec.json: what a run learns from and how, recorded at its first start, so that a rerun or resume with
another model, data, batch, optimizer, schedule or adapter is refused instead of silently mixing two runs.

How long a run trains, how often it evaluates and checkpoints, where it reports and how it is laid out on workers
may change between starts (its checkpoints reshard to other worker counts and meshes): those fields are not
recorded. The training data is recorded by its content, so the same rows at another path resume.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow.fs as pafs

from trainlift.config.job import JobSpec
from trainlift.errors import UsageError

RECORD = "spec.json"
RESUMABLE = ("train.steps", "train.eval_every", "train.accum_sync", "data.eval", "data.eval_examples",
             "model.attn_implementation", "model.activation_checkpointing",
             "scaling.", "parallel.", "checkpoint.", "export.", "run.", "runtime.")
ALLOW_FLAG = "--allow-spec-change"


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): value}


def _resumable(field: str) -> bool:
    """Entries ending in a dot name a whole section; the others a field (and what is nested under it)."""
    return any(field.startswith(r) if r.endswith(".") else field == r or field.startswith(r + ".") for r in RESUMABLE)


def training_fields(spec: JobSpec, train_data_fingerprint: str) -> dict[str, Any]:
    """The spec's fields that decide what the run learns, dotted, with data.train as its content's hash."""
    fields = {k: v for k, v in _flatten(spec.model_dump(mode="json")).items() if not _resumable(k)}
    fields["data.train"] = f"sha256:{train_data_fingerprint}"
    return fields


def changed_fields(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """`field old → new` for each field that differs; data.train says its content changed."""
    out = []
    for field in sorted(set(recorded) | set(current)):
        old, new = recorded.get(field), current.get(field)
        if old == new:
            continue
        out.append(f"{field} (its rows changed)" if field == "data.train" else f"{field} {_show(old)} → {_show(new)}")
    return out


def _show(value: Any) -> str:
    return "unset" if value is None else json.dumps(value) if isinstance(value, (list, dict, str)) else str(value)


def read(spec: JobSpec) -> dict[str, Any] | None:
    fs, path = pafs.FileSystem.from_uri(spec.run_uri)
    try:
        with fs.open_input_stream(f"{path}/{RECORD}") as src:
            record = json.loads(src.read())
    except (FileNotFoundError, ValueError):
        return None
    except OSError:
        if fs.get_file_info(f"{path}/{RECORD}").type == pafs.FileType.NotFound:
            return None
        raise
    return record.get("fields") if isinstance(record, dict) else None


def write(spec: JobSpec, fields: dict[str, Any]) -> None:
    fs, path = pafs.FileSystem.from_uri(spec.run_uri)
    fs.create_dir(path, recursive=True)
    with fs.open_output_stream(f"{path}/{RECORD}") as out:
        out.write(json.dumps({"fields": fields}, indent=2, sort_keys=True).encode())


def check(spec: JobSpec, current: dict[str, Any], allow_change: bool) -> list[str]:
    """The changes from the recorded spec; refused in one line unless `allow_change`. A run with no record (a new
    one, or one started before runs recorded their spec) has none."""
    recorded = read(spec)
    changes = [] if recorded is None else changed_fields(recorded, current)
    if changes and not allow_change:
        raise UsageError(f"run {spec.run.name} was started with another spec: {'; '.join(changes)}",
                         hint=f"train it with the spec it started with, give this one another run.name, or pass "
                              f"{ALLOW_FLAG} to go on from its checkpoint with the new values (its optimizer state "
                              "and data position stay the old run's)")
    return changes
