"""How a training job starts on a Ray cluster: its entrypoint and runtime_env, the same for `trainlift submit`
(Ray Jobs API) and the rendered RayJob.

The cluster's image (the Ray Train DLC) has no trainlift, so the entrypoint runs it as a module that the
runtime_env's `py_modules` ships; the job's files (spec, data) come with `working_dir`.
"""

from __future__ import annotations

import shlex
from typing import Any, Sequence


def job_entrypoint(spec_path: str, overrides: Sequence[str] = ()) -> str:
    args = ["python", "-m", "trainlift", "train", spec_path]
    for override in overrides:
        args += ["--set", override]
    return shlex.join(args)


# The Hugging Face libraries' progress bars ("Writing model shards", "Loading weights") and advisories off in the
# job, by their documented settings (huggingface_hub's HF_HUB_DISABLE_PROGRESS_BARS, which transformers' bars
# follow; TRANSFORMERS_VERBOSITY): the job's log is read as a run's progress.
QUIET_JOB_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
                 "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}


def job_runtime_env(working_dir: str | None, py_modules: Sequence[str], excludes: Sequence[str] = (),
                    pip: Sequence[str] = (), env_vars: dict[str, str] | None = None) -> dict[str, Any]:
    """working_dir and py_modules: local paths (submit uploads them) or remote URIs (a RayJob's zips on S3); `pip`:
    hashed requirement lines, installed by pip in hash-checking mode."""
    env: dict[str, Any] = {}
    if working_dir is not None:
        env["working_dir"] = working_dir
    if excludes:
        env["excludes"] = list(excludes)
    env["py_modules"] = list(py_modules)
    env["env_vars"] = {"PYTHONUNBUFFERED": "1", **QUIET_JOB_ENV, **(env_vars or {})}
    if pip:  # hash-checked: every line pinned with its sha256 (catalog.packages.runtime_pip)
        from trainlift.catalog.packages import HASHED_PIP_OPTIONS

        env["pip"] = {"packages": list(pip), "pip_install_options": list(HASHED_PIP_OPTIONS)}
    return env
