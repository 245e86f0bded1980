"""`trainlift doctor --address http://HEAD:8265`: the every-node probe, run as a Ray job on the cluster itself.

Ray Client (`ray://`) refuses a laptop whose Ray or Python minor version differs from the cluster's (the DLC has
Ray 2.58 on Python 3.13), so the probe does not connect from here. It is submitted through the Jobs API with
trainlift as a wheel; its driver runs on the head with the image's Python and Ray (`doctor --address auto`), and
its JSON report is read back from the job's log.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from trainlift.errors import TrainliftError

JOB_TIMEOUT_S = 900.0  # a first run installs the wheel on every node; the probe itself allows 180 s per node


def doctor_entrypoint(expect_fabric: str) -> str:
    return f"python -m trainlift doctor --address auto --expect-fabric {expect_fabric} --json"


def run_on_cluster(dashboard: str, expect_fabric: str, env_vars: dict[str, str] | None = None,
                   timeout_s: float = JOB_TIMEOUT_S) -> dict[str, Any]:
    """Submit the probe as a job at the dashboard `dashboard` (with `env_vars` in every node's probe), wait for it,
    and return the report it printed."""
    from trainlift.ops import jobs, package

    client = jobs.client(dashboard)
    wheel = package.build_wheel(package.default_dir())
    job_id = client.submit_job(entrypoint=doctor_entrypoint(expect_fabric), runtime_env={"py_modules": [str(wheel)], "env_vars": dict(env_vars or {})},
                               submission_id=f"trainlift-doctor-{uuid.uuid4().hex[:8]}",
                               metadata={"trainlift.kind": "doctor"})
    status = jobs.wait(client, job_id, timeout_s)
    if status is None:
        raise TrainliftError(f"the doctor job {job_id} did not finish within {timeout_s:.0f} s",
                             hint=f"see its log: trainlift jobs logs {job_id} --address {dashboard}")
    logs = client.get_job_logs(job_id)
    report = report_from_logs(logs)
    if report is None:
        tail = " | ".join(line for line in logs.strip().splitlines()[-3:]) or "no output"
        raise TrainliftError(f"the doctor job {job_id} ended {status} without a report: {tail}",
                             hint=f"see its log: trainlift jobs logs {job_id} --address {dashboard}")
    return {**report, "address": dashboard, "job_id": job_id}


def report_from_logs(logs: str) -> dict[str, Any] | None:
    """The last report `doctor --json` printed in a log (indented over many lines, maybe among Ray's own lines)."""
    lines = logs.splitlines()
    decoder = json.JSONDecoder()
    for start in reversed([i for i, line in enumerate(lines) if line == "{"]):
        try:
            report, _ = decoder.raw_decode("\n".join(lines[start:]))
        except ValueError:
            continue
        if isinstance(report, dict) and "findings" in report and "nodes" in report:
            return report
    return None
