"""The rehearsal's own run: the job's run.storage under `<run.name>-rehearsal`, so that the job, once it runs for
real, never finds the rehearsal's toy model in its run (it would resume it, or be refused by its spec). Pure: the
job spec's text comes from the caller (ops/rehearse.py reads it from the working_dir on S3)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

import yaml

from trainlift.errors import TrainliftError

REHEARSAL_SUFFIX = "-rehearsal"
JOB_RUN_DEFAULTS = {"name": "run", "storage": "runs"}  # config/job.py RunSection's defaults


@dataclass(frozen=True)
class RehearsalRun:
    """The rehearsal's run: the job's run.storage, under a run name of its own, so the real job never finds (and
    resumes, or is refused by) the rehearsal's toy model. `storage` is "" when the job's spec could not be read."""

    job_run_name: str
    storage: str
    chosen: str | None = None  # a run.name the user gave `rehearse --set`: theirs, as every --set of theirs

    @property
    def name(self) -> str:
        return self.chosen or self.job_run_name + REHEARSAL_SUFFIX

    @property
    def uri(self) -> str:
        return f"{self.storage.rstrip('/')}/{self.name}" if self.storage else f"<run.storage>/{self.name}"

    @property
    def job_uri(self) -> str:
        return f"{self.storage.rstrip('/')}/{self.job_run_name}" if self.storage else self.job_run_name


def entrypoint_spec(entrypoint: str) -> tuple[str, list[str]] | None:
    """The spec path of the entrypoint's `trainlift train SPEC` and its `--set` overrides; None for another command."""
    argv = shlex.split(entrypoint)
    if "train" not in argv:
        return None
    at = argv.index("train")
    if at + 1 >= len(argv):
        return None
    overrides = [argv[i + 1] for i in range(at + 2, len(argv) - 1) if argv[i] == "--set"]
    overrides += [a[len("--set="):] for a in argv[at + 2:] if a.startswith("--set=")]
    return argv[at + 1], overrides


def job_run(spec_text: str | None, entrypoint_overrides: list[str], overrides: list[str],
            fallback_name: str) -> RehearsalRun:
    """The job's run.name and run.storage (the spec in its working_dir, then the entrypoint's and the user's
    `--set`), as the rehearsal's own run is made from them. An unreadable spec leaves the RayJob's name."""
    from trainlift.config.job import apply_overrides

    chosen = _last(overrides, "run.name")
    if spec_text is None:
        return RehearsalRun(_last(entrypoint_overrides, "run.name") or fallback_name,
                            _last([*entrypoint_overrides, *overrides], "run.storage") or "", chosen)
    try:
        raw = yaml.safe_load(spec_text) or {}
        job = {**JOB_RUN_DEFAULTS, **(apply_overrides(raw, _run_fields(entrypoint_overrides)).get("run") or {})}
    except (yaml.YAMLError, ValueError, AttributeError, TrainliftError):
        return job_run(None, entrypoint_overrides, overrides, fallback_name)
    return RehearsalRun(str(job["name"]), _last(overrides, "run.storage") or str(job["storage"]), chosen)


def _run_fields(overrides: list[str]) -> list[str]:
    return [o for o in overrides if o.startswith("run.")]


def _last(overrides: list[str], key: str) -> str | None:
    return next((o.partition("=")[2] for o in reversed(overrides) if o.partition("=")[0].strip() == key), None)


def spec_from_zip(data: bytes, spec_path: str) -> str | None:
    """The job spec's text inside a working_dir zip (its files at the top, or under one folder); None if absent."""
    import io
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            names = z.namelist()
            found = next((n for n in names if n == spec_path or n.endswith("/" + spec_path)), None)
            return z.read(found).decode("utf-8", "replace") if found else None
    except (zipfile.BadZipFile, OSError):
        return None


def run_line(run: RehearsalRun | None, summary: dict[str, Any]) -> str:
    """'rehearsal run: s3://…/name-rehearsal: 4 steps, loss 3.1234, eval loss 3.2000 (the job's run … untouched)'."""
    if run is None:
        return "rehearsal run: where the job's spec says"
    figures = []
    if summary.get("steps") is not None:
        figures.append(f"{summary['steps']} steps")
    for key, label in (("final_loss", "loss"), ("eval_loss", "eval loss")):
        if isinstance(summary.get(key), (int, float)):
            figures.append(f"{label} {summary[key]:.4f}")
    said = f": {', '.join(figures)}" if figures else ""
    return f"rehearsal run: {run.uri}{said} (the job's own run, {run.job_uri}, is not touched)"
