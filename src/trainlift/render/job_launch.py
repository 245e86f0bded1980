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


def job_runtime_env(working_dir: str | None, py_modules: Sequence[str], excludes: Sequence[str] = (),
                    pip: Sequence[str] = (), env_vars: dict[str, str] | None = None) -> dict[str, Any]:
    """working_dir and py_modules: local paths (submit uploads them) or remote URIs (a RayJob's zips on S3)."""
    env: dict[str, Any] = {}
    if working_dir is not None:
        env["working_dir"] = working_dir
    if excludes:
        env["excludes"] = list(excludes)
    env["py_modules"] = list(py_modules)
    env["env_vars"] = {"PYTHONUNBUFFERED": "1", **(env_vars or {})}
    if pip:
        env["pip"] = list(pip)
    return env
