"""Ship a job spec to a Ray cluster through the Job Submission API, and follow it.

The job runs `python -m trainlift train <spec>` in the cluster, with the
project directory as its working_dir and trainlift itself in py_modules as a
wheel (ops/package.py), so the cluster's image (e.g. the Ray Train DLC) is used
unmodified. The wheel, unlike a directory, is not filtered by runtime_env
`excludes` (the project's .gitignore patterns): trainlift always ships whole.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from trainlift.errors import TrainliftError, UsageError
from trainlift.ops import localray, package
from trainlift.progress_lines import PROGRESS_ENV, PROGRESS_PREFIX
from trainlift.redact import refuse_uri_credentials, uri_credentials
from trainlift.render.job_launch import job_entrypoint, job_runtime_env

TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
ACTIVE = {"PENDING", "RUNNING"}
RUN_METADATA = "trainlift_run"  # the job's metadata key holding its spec's run.name
PORT_FORWARD_HINT = ("for a cluster on EKS: kubectl port-forward svc/<cluster>-head-svc 8265:8265 and use "
                     "http://localhost:8265; for this machine: trainlift local up")


def resolve_address(address: str | None) -> str:
    """--address, else RAY_ADDRESS, else the head from `trainlift local up`."""
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        state = localray.read_state()
        address = state["dashboard_url"] if state else localray.last_dashboard_url()
        if address is None:
            raise UsageError("no Ray address", hint="pass --address http://HEAD:8265, set RAY_ADDRESS, or run "
                                                    "`trainlift local up`")
    if "://" not in address:
        address = f"http://{address}"
    return address.rstrip("/")


def check_reachable(address: str, timeout: float = 5.0, gone: str | Callable[[], str] = "") -> None:
    """Fail fast with one line: the SDK's own retries take far longer on a dead address. `gone`: what that means
    for the command at hand (its job, its run), appended to the line."""
    if localray.dashboard_up(address, timeout=timeout):
        return
    gone = gone() if callable(gone) else gone
    raise TrainliftError(f"cannot reach the Ray dashboard at {address}{gone}", hint=PORT_FORWARD_HINT)


def status_gone(job_id: str) -> str:
    return (f": the head is gone or unreachable, and with it what Ray knew of job {job_id}; once a head is up "
            "(`trainlift local up`, or on EKS the RayJob's retry), resubmit the job's spec: it resumes from the "
            "run's latest complete checkpoint")


def submit_gone(run_name: str, run_uri: str) -> str:
    """The head-gone clause for `submit`, with the step a resubmission will resume at when the run's storage
    is readable from here."""
    step = latest_checkpoint_step(run_uri)
    if step is False:
        then = "once a head is up, this same command resumes from the run's latest complete checkpoint"
    elif step is None:
        then = f"run {run_name!r} has no complete checkpoint yet: once a head is up, this same command starts it over"
    else:
        then = f"once a head is up, this same command resumes run {run_name!r} from its checkpoint at step {step}"
    return f": the head is gone or unreachable; {then}"


def latest_checkpoint_step(run_uri: str) -> int | None | bool:
    """The run's latest complete checkpoint step, None without one, False when its storage is not readable here."""
    from trainlift.rundir import open_uri
    from trainlift.train.run.checkpoint import latest_complete

    try:
        fs, path = open_uri(run_uri)
        latest = latest_complete(fs, path.rstrip("/"))
    except (OSError, TrainliftError):
        return False
    return latest[0] if latest else None


def auth_headers() -> dict[str, str]:
    """Ray's token authentication, the token found as Ray finds it (localray.read_auth_token)."""
    token = localray.read_auth_token()
    return {"Authorization": f"Bearer {token}"} if token else {}


def client(address: str, gone: str | Callable[[], str] = ""):
    from ray.job_submission import JobSubmissionClient

    logging.getLogger("ray").setLevel(logging.WARNING)  # the SDK logs every upload step at INFO
    check_reachable(address, gone=gone)
    try:
        return JobSubmissionClient(address, headers=auth_headers())
    except Exception as exc:  # noqa: BLE001 - the SDK raises several types; show its first line only
        raise TrainliftError(f"the Ray dashboard at {address} refused the connection: {str(exc).splitlines()[0]}",
                             hint="set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to the cluster's token") from None


SECRET_ENV_HINT = ("on EKS put it in a Kubernetes Secret and list it under the cluster spec's `secrets` (env, secret, "
                   "key) so the workers' environment has it; on this machine export it in the shell that runs "
                   "`trainlift local up`")


def _secret_like(name: str, value: str) -> bool:
    """A name that says credential whatever its value (render.rules' words, or a last word KEY), or a value
    shaped like a token."""
    from trainlift.render.rules import looks_secret

    return looks_secret(name, value) or looks_secret(name, "any") or name.upper().rsplit("_", 1)[-1] == "KEY"


def parse_env(pairs: list[str], environ: Mapping[str, str]) -> dict[str, str]:
    """`--env KEY=VALUE`, or `KEY` alone for the value `environ` (this shell) has. A secret is refused either way:
    the job's runtime_env, env_vars included, is on view in the Ray dashboard."""
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not key.isidentifier():
            raise UsageError(f"--env {key[:40]!r}: expected KEY=VALUE, or KEY to pass this shell's value")
        if not sep:
            if key not in environ:
                raise UsageError(f"--env {key}: not set in this shell", hint=f"export {key}=... first")
            value = environ[key]
        if _secret_like(key, value):  # the value is not echoed: it is the thing being protected
            raise UsageError(f"--env {key}: a secret passed to the job lands in its runtime_env, which the Ray "
                             "dashboard shows", hint=SECRET_ENV_HINT)
        refuse_uri_credentials(f"--env {key}", value)
        env[key] = value
    return env


def submission_id(run_name: str, spec_text: str, entrypoint: str, runtime_env: dict[str, Any]) -> str:
    """Same spec and options, same id: a resubmission attaches instead of starting a second job."""
    payload = json.dumps({"spec": spec_text, "entrypoint": entrypoint,
                          "env": {k: v for k, v in runtime_env.items() if k != "working_dir"}}, sort_keys=True)
    return f"trainlift-{run_name}-{hashlib.sha256(payload.encode()).hexdigest()[:10]}"


def entrypoint(spec_path: str, overrides: list[str]) -> str:
    return job_entrypoint(spec_path, overrides)


def runtime_env(working_dir: Path, excludes: list[str], pip: list[str], env_vars: dict[str, str]) -> dict[str, Any]:
    """The project directory as working_dir and this trainlift as a wheel in py_modules, both uploaded by Ray;
    the job's `trainlift train` prints machine-readable progress lines for `submit --follow` and `jobs logs`, and
    no library progress bars (the user's --env wins)."""
    wheel = package.build_wheel(package.default_dir())
    return job_runtime_env(str(working_dir), [str(wheel)], excludes, pip,
                           {PROGRESS_ENV: "json", **env_vars})


def job_with_prefix(job_client, prefix: str) -> str:
    """The submission id `prefix` names: itself when a job has that id, else the one job whose id starts with it
    (an id cut short by a narrow table still works). None or several: one line saying so."""
    ids = sorted({info.submission_id or info.job_id for info in job_client.list_jobs()} - {None})
    return matching_job(ids, prefix)


def matching_job(ids: list[str], prefix: str) -> str:
    if prefix in ids:
        return prefix
    found = [job_id for job_id in ids if job_id.startswith(prefix)]
    if len(found) == 1:
        return found[0]
    if not found:
        raise UsageError(f"no job {prefix!r} on this cluster", hint="trainlift jobs list shows the jobs' ids")
    raise UsageError(f"{prefix!r} names {len(found)} jobs: {', '.join(found)}", hint="give more of the id")


def refuse_if_run_active(job_client, run_name: str) -> None:
    """One run, one active job: two would write checkpoints and metrics into the same <storage>/<run.name>."""
    for info in job_client.list_jobs():
        status = str(info.status.value)
        if status in ACTIVE and (info.metadata or {}).get(RUN_METADATA) == run_name:
            job_id = info.submission_id or info.job_id
            raise UsageError(f"run {run_name!r} already has an active job {job_id} ({status}); a second one would "
                             "write into the same run directory",
                             hint=f"stop it first: trainlift jobs stop {job_id}, or give this job its own run: "
                                  "--set run.name=NEW_NAME")


def submit(job_client, sub_id: str, entry: str, env: dict[str, Any], metadata: dict[str, str]) -> tuple[str, bool]:
    """Attach to the attempt of this id that is still PENDING or RUNNING; when every earlier attempt has ended
    (FAILED, STOPPED, SUCCEEDED), submit the next one (`<id>-2`, `<id>-3`, ...), which resumes from the run's
    newest complete checkpoint. Refuses while another job of the same run is active.
    Returns (the attempt's id, whether it was created)."""
    for attempt in itertools.count(1):
        attempt_id = sub_id if attempt == 1 else f"{sub_id}-{attempt}"
        try:
            status = str(job_client.get_job_info(attempt_id).status.value)
        except RuntimeError:
            refuse_if_run_active(job_client, metadata[RUN_METADATA])
            job_client.submit_job(entrypoint=entry, submission_id=attempt_id, runtime_env=env, metadata=metadata)
            return attempt_id, True
        if status in ACTIVE:
            return attempt_id, False
    raise AssertionError("itertools.count does not end")


def follow(job_client, job_id: str, on_line: Callable[[str], None]) -> str:
    """Stream the job's log lines until it ends; returns its final status."""

    async def tail() -> None:
        buffer = ""
        async for chunk in job_client.tail_job_logs(job_id):
            buffer += chunk
            *lines, buffer = buffer.split("\n")
            for line in lines:
                on_line(line)
        if buffer:
            on_line(buffer)

    asyncio.run(tail())
    status = str(job_client.get_job_status(job_id).value)
    while status not in TERMINAL:  # the log stream can close a moment before the status settles
        time.sleep(0.5)
        status = str(job_client.get_job_status(job_id).value)
    return status


def wait(job_client, job_id: str, timeout_s: float, poll_s: float = 1.0) -> str | None:
    """Poll until the job ends; its final status, or None once `timeout_s` has passed (the job is then stopped)."""
    deadline = time.monotonic() + timeout_s
    status = str(job_client.get_job_status(job_id).value)
    while status not in TERMINAL:
        if time.monotonic() > deadline:
            job_client.stop_job(job_id)
            return None
        time.sleep(poll_s)
        status = str(job_client.get_job_status(job_id).value)
    return status


def parse_progress(line: str) -> dict[str, Any] | None:
    index = line.find(PROGRESS_PREFIX)
    if index < 0:
        return None
    try:
        return json.loads(line[index + len(PROGRESS_PREFIX):])
    except json.JSONDecodeError:
        return None


def error_tail(job_client, job_id: str, lines: int = 15) -> list[str]:
    info = job_client.get_job_info(job_id)
    logs = job_client.get_job_logs(job_id).strip().splitlines()
    tail = [line for line in logs if not line.startswith(PROGRESS_PREFIX)][-lines:]
    return ([info.message] if info.message else []) + tail


def job_row(info) -> dict[str, Any]:
    return {"id": info.submission_id or info.job_id, "status": str(info.status.value),
            "entrypoint": uri_credentials(info.entrypoint or ""),
            "start_time": info.start_time, "end_time": info.end_time, "message": info.message,
            "metadata": info.metadata or {}}


def cluster_token(kubeconfig: str, namespace: str, secret: str) -> str | None:
    """The Ray token of a RayCluster on Kubernetes: key `auth_token` of the Secret KubeRay creates for it
    (render.raycluster.auth_secret_name), read through kubectl; None when there is no such Secret (a cluster
    rendered without token authentication). The token is never printed or passed on a command line."""
    import base64
    import binascii

    from trainlift.ops import kube
    from trainlift.ops.run import CommandFailed, check
    from trainlift.render.raycluster import AUTH_TOKEN_KEY

    argv = kube.kubectl(kubeconfig, "-n", namespace, "get", "secret", secret, "-o",
                        f"jsonpath={{.data.{AUTH_TOKEN_KEY}}}")
    try:
        encoded = check(argv, 60).stdout.strip()
    except CommandFailed as exc:
        if "(NotFound)" in exc.result.stderr:
            return None
        raise TrainliftError(f"cannot read the Ray token from Secret {namespace}/{secret}: {exc.message}",
                             hint="check that this kubeconfig may get secrets in the namespace") from None
    try:
        return base64.b64decode(encoded, validate=True).decode().strip() or None
    except (binascii.Error, UnicodeDecodeError):
        raise TrainliftError(f"Secret {namespace}/{secret} holds no readable auth_token",
                             hint="delete the Secret and the RayCluster, then `trainlift cluster up` again: "
                                  "KubeRay writes a new token") from None


@contextmanager
def forwarded_head(kubeconfig: Path, namespace: str, cluster: str, secret: str) -> Iterator[str]:
    """The head's dashboard on this machine (kubectl port-forward, ops.forward) while the block runs, with this
    process's RAY_AUTH_TOKEN set to the cluster's token (from its Secret), which the Jobs API client sends."""
    from trainlift.ops.forward import head_dashboard

    from trainlift.ops.run import environ_set

    with head_dashboard(kubeconfig, namespace, cluster) as url:
        token = cluster_token(str(kubeconfig), namespace, secret)
        with environ_set({"RAY_AUTH_TOKEN": token} if token else {}):
            yield url
