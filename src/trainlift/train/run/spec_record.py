"""<run>/spec.json: what a run learns from and how, recorded at its first start, so that a rerun or resume with
another model, data, sequence length, optimizer, schedule or adapter is refused instead of silently mixing two runs.

How long a run trains, how often it evaluates and checkpoints, where it reports and how it is laid out on workers
(workers, mesh, micro-batch, accumulation) may change between starts: its checkpoints reshard to other worker
counts and meshes. Those fields are not recorded. The training data is recorded by its content, so the same rows
at another path resume. A DPO run also records its objective and `train.dpo` (its reference log-probs and what it
optimises depend on them); an SFT run leaves them out, so a record written before they existed still matches.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pyarrow.fs as pafs

from trainlift import rundir
from trainlift.config.job import JobSpec
from trainlift.errors import UsageError
from trainlift.home import expand_user

RECORD = "spec.json"
# The batch's layout (micro-batch, accumulation, workers) may change with the hardware: a checkpoint reshards to
# another worker count, and the data position is kept in rows, so 4 workers x 2 rows resume as 2 x 4. The attention
# kernel, activation checkpointing and compiling change how a step is computed, not what it computes.
RESUMABLE = ("train.steps", "train.schedule_extension", "train.eval_every", "train.accum_sync", "train.micro_batch_size", "train.grad_accum",
             "train.compile", "data.eval", "data.eval_examples",
             "model.attn_implementation", "model.activation_checkpointing", "model.activation_checkpointing_every",
             "model.activation_checkpointing_keeps",
             "scaling.", "parallel.", "checkpoint.", "export.", "run.", "runtime.")
ALLOW_FLAG = "--allow-spec-change"
GONE = "gone from this machine"  # a local model path that no longer exists: not compared
TO_BUILD = "to be built from model.config"  # recorded only by a start that died before building it: not compared
SMALL_FILE_BYTES = 16 << 20  # config, tokenizer and index files are hashed whole
# Weight files by name, size and these many blocks spread over the file: a fine-tuned export has its base's names
# and sizes, and its bytes differ everywhere.
SAMPLED_BLOCKS, SAMPLED_BLOCK_BYTES = 16, 4096
IDENTITY = "sampled-sha256:"


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
    """The spec's fields that decide what the run learns, dotted, with data.train as its content's hash and local
    model, tokenizer and config paths as what they hold: a job's working directory lands at another path on every
    submission."""
    fields = {k: v for k, v in _flatten(spec.model_dump(mode="json")).items() if not _resumable(k)}
    fields["data.train"] = f"sha256:{train_data_fingerprint}"
    if spec.train.objective == "sft":  # DPO's fields shape nothing else (and records from before them still match)
        fields = {k: v for k, v in fields.items() if k != "train.objective" and not k.startswith("train.dpo.")}
    for field in ("model.path", "model.tokenizer", "model.config"):
        if isinstance(fields.get(field), str):
            fields[field] = local_identity(fields[field])
    if spec.model.config is not None and fields.get("model.path") == GONE:
        fields["model.path"] = TO_BUILD  # with_built_model records what it holds once built
    return fields


def with_built_model(spec: JobSpec, fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` with the model that model.config built at model.path recorded as what it holds."""
    if fields.get("model.path") != TO_BUILD:
        return fields
    return {**fields, "model.path": local_identity(spec.model.path)}


def local_identity(path: str) -> str:
    """A local file or model directory as a hash of what it holds (a directory: every file's name and size, the
    content of its small files: config, tokenizer, index; of a large one, blocks spread over it); anything else
    as given."""
    local = expand_user(path)
    if "://" in path or not local.is_absolute():
        return path
    if not local.exists():  # gone since (a full fine-tune resumes from its checkpoint alone): not comparable
        return GONE
    digest = hashlib.sha256()
    for file in sorted(f for f in (local.iterdir() if local.is_dir() else [local]) if f.is_file()):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as src:
            if size <= SMALL_FILE_BYTES:
                digest.update(src.read())
                continue
            for block in range(SAMPLED_BLOCKS):
                src.seek((size - SAMPLED_BLOCK_BYTES) * block // (SAMPLED_BLOCKS - 1))
                digest.update(src.read(SAMPLED_BLOCK_BYTES))
    return f"{'directory' if local.is_dir() else 'file'} {IDENTITY}{digest.hexdigest()}"


def _comparable(old: Any, new: Any) -> bool:
    """Not a path gone or not built yet, nor an identity taken the way records before sampled weights took it."""
    if new == GONE or old == TO_BUILD:
        return False
    identities = all(isinstance(v, str) and "sha256:" in v for v in (old, new))
    return not identities or (IDENTITY in old) == (IDENTITY in new)


def changed_fields(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """`field old → new` for each field that differs; data.train says its content changed."""
    out = []
    for field in sorted(set(recorded) | set(current)):
        old, new = recorded.get(field), current.get(field)
        if old == new or not _comparable(old, new):
            continue
        if field == "model.path" and field not in recorded and any(k.startswith("model.config") for k in recorded):
            continue  # recorded before a model.path that model.config builds was
        if field == "data.train":
            out.append(f"{field} (its rows changed)")
        elif all(isinstance(v, str) and "sha256:" in v for v in (old, new)):
            out.append(f"{field} (what it holds changed)")
        else:
            out.append(f"{field} {_show(old)} → {_show(new)}")
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
    """The record, keeping what it held for a local path that is gone now; a link in its place is refused."""
    if GONE in fields.values():
        fields = {**fields, **{k: v for k, v in (read(spec) or {}).items() if fields.get(k) == GONE}}
    fs, path = pafs.FileSystem.from_uri(spec.run_uri)
    fs.create_dir(path, recursive=True)
    rundir.write_file(fs, f"{path}/{RECORD}", json.dumps({"fields": fields}, indent=2, sort_keys=True).encode())


def check(spec: JobSpec, current: dict[str, Any], allow_change: bool, trained: bool) -> list[str]:
    """The changes from the recorded spec; refused in one line unless `allow_change`. Only a run that `trained`
    (it finished, or has a complete checkpoint) has something to mix: before that, a rerun starts over with the
    spec it is given (a start that failed on bad rows, rerun with the rows fixed). A run with no record (a new
    one, or one started before runs recorded their spec) has no changes."""
    recorded = read(spec) if trained else None
    changes = [] if recorded is None else changed_fields(recorded, current)
    if changes and not allow_change:
        raise UsageError(f"run {spec.run.name} was started with another spec: {'; '.join(changes)}",
                         hint=f"train it with the spec it started with, give this one another run.name, or pass "
                              f"{ALLOW_FLAG} to go on from its checkpoint with the new values (its optimizer state "
                              "and data position stay the old run's)")
    return changes
