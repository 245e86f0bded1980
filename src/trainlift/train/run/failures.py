"""Ray's failure of a training run, as the one line the user reads: the innermost error out of Ray's wrapping,
then named for what it means (object storage lost, no room for the workers) with how to go on."""

from __future__ import annotations

import os
import re

from trainlift.config.job import JobSpec
from trainlift.errors import TrainliftError

START_RETRIES = 3  # worker-group starts that time out (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S) before giving up


def explain(spec: JobSpec, exc: BaseException, log_path: str | os.PathLike, ray_said: str | None = None
            ) -> TrainliftError:
    """`log_path`: where every line Ray printed is; `ray_said`: the last warning Ray gave before the failure,
    added to the line when it says something new."""
    cause = root_cause(exc)
    error = storage_failure(spec, cause) or no_room_failure(spec, cause) or TrainliftError(
        f"training failed: {cause}", hint=f"every line Ray printed is in {log_path}; run state is in {spec.run_uri}")
    if ray_said and ray_said not in error.message:
        error.message = f"{error.message} (before it, Ray said: {ray_said})"
    return error


_START_TIMEOUT = re.compile(r"worker group startup timed out after [\d.]+ seconds waiting for (?P<n>\d+) workers")


def no_room_failure(spec: JobSpec, cause: str) -> TrainliftError | None:
    """Ray Train could not place the worker group, every try: the cluster no longer has room for it."""
    match = _START_TIMEOUT.search(cause)
    if match is None:
        return None
    return TrainliftError(
        f"training failed: {match['n']} workers no longer fit the cluster (a node lost?); Ray could not start "
        f"them in {START_RETRIES + 1} tries",
        hint=f"bring the nodes back, or make the run elastic with scaling.workers: [min, {match['n']}]; "
             f"rerunning resumes from the last complete checkpoint in {spec.run_uri}")


def root_cause(exc: BaseException) -> str:
    """The innermost error's own message, out of Ray's wrapping and the remote traceback."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    starts = [i for i, line in enumerate(lines) if re.match(r"^[\w.]+(Error|Exception): ", line)]
    if starts:
        return re.sub(r"^[\w.]+: ", "", " ".join(lines[starts[-1]:]))
    return lines[-1] if lines else type(exc).__name__


# pyarrow's S3 errors: "When <doing> for key '<key>' in bucket '<b>': AWS Error <CODE> during <Op> operation: <detail>"
_AWS_ERROR = re.compile(r"AWS Error (?P<code>\w+) during (?P<op>\w+) operation: (?P<detail>.*)")
_CURL_REASON = re.compile(r"curlCode: \d+, (?P<reason>[^;]+)")
_CURL_HOST = re.compile(r"Failed to connect to (?P<host>[^\s:]+)(?::| port )(?P<port>\d+)")
_RESUME_HINT = ("checkpoints without a COMPLETE marker are never resumed from; once the storage works again, "
                "rerun the same command to resume from the last complete checkpoint")


def storage_failure(spec: JobSpec, cause: str) -> TrainliftError | None:
    """A failure of object storage during training, as one line naming the run's URI, what broke and how to resume;
    None when `cause` is not a storage failure (or the run is on a local disk)."""
    if not spec.is_remote_storage:
        return None
    if "was not fully uploaded" in cause:  # checkpoint.IncompleteCheckpointError
        return TrainliftError(f"training failed: {spec.run_uri}: {cause}",
                              hint=f"the storage lost part of the upload; {_RESUME_HINT}")
    aws = _AWS_ERROR.search(cause)
    if aws is None:
        return None
    code, op, detail = aws["code"], aws["op"], aws["detail"]
    if code == "NETWORK_CONNECTION":
        host = _CURL_HOST.search(detail)
        endpoint = (f"{host['host']}:{host['port']}" if host else os.environ.get("AWS_ENDPOINT_URL")) or "S3"
        reason = _CURL_REASON.search(detail)
        return TrainliftError(
            f"training failed: lost the connection to run.storage {spec.run_uri}: the S3 endpoint {endpoint} is "
            f"unreachable ({reason['reason'].strip() if reason else 'network error'}, during {op})",
            hint=_RESUME_HINT)
    return TrainliftError(f"training failed: run.storage {spec.run_uri}: S3 answered {code} to {op} ({detail.strip()})",
                          hint=_RESUME_HINT)
