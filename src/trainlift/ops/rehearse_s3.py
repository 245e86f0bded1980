"""The pods' S3 role, enforced on a rehearsal: every request the job and its Ray make, as the S3 server saw it,
judged against the rendered policy with IAM's rules (render/iam_eval.py, render/s3_requests.py).

The requests come from the S3 server's own request recorder (moto_server's `/moto-api/recorder/`): it keeps each
request's method, URL (bucket, key, query such as `prefix`), headers and body, whichever client sent it (Ray's
runtime_env download, pyarrow, boto3). Recording runs from just before the job is submitted to just after it ends.
AWS itself, or a server without a recorder, records nothing here: then the role is checked on paper only, and the
check says so. The policy is never enforced inline (the job runs with this environment's credentials): a request
the role would deny fails the rehearsal afterwards, in one line naming the call, its key and the missing statement.
"""

from __future__ import annotations

import contextlib
import os
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping
from urllib.parse import urlsplit

from trainlift.render.iam_eval import PolicyError, listed, statements
from trainlift.render.s3_requests import (S3Call, denial_line, denials, operation_counts, recorded_requests,
                                          s3_call)

RECORDER = "/moto-api/recorder/"
TIMEOUT_S = 10.0
ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


@dataclass
class Tape:
    """What the S3 server recorded (`text`), or why nothing was (`why_not`)."""

    endpoint: str
    text: str = ""
    why_not: str = ""


def s3_endpoint(environ: Mapping[str, str] = os.environ) -> str:
    """The S3 endpoint this environment names ("" for AWS's own)."""
    return next((environ[k].rstrip("/") for k in ENDPOINT_ENV if environ.get(k)), "")


def _call(endpoint: str, verb: str, method: str = "POST") -> str:
    request = urllib.request.Request(endpoint + RECORDER + verb, data=b"" if method == "POST" else None, method=method)
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        return response.read().decode("utf-8", "replace")


@contextlib.contextmanager
def recording(endpoint: str) -> Iterator[Tape]:
    """Record every request the S3 server at `endpoint` receives inside the block (its recording is emptied before
    and after); the tape says why not when there is no such server or it keeps no recording."""
    tape = Tape(endpoint)
    if not endpoint:
        tape.why_not = "S3 is AWS's own here (no AWS_ENDPOINT_URL): AWS authorises the requests as you, not the role"
        yield tape
        return
    try:
        for verb in ("stop-recording", "reset-recording", "start-recording"):
            _call(endpoint, verb)
    except (urllib.error.URLError, OSError) as exc:
        tape.why_not = (f"the S3 server at {endpoint} keeps no request recording ({_reason(exc)}); moto_server "
                        "does, and then every request is judged")
        yield tape
        return
    try:
        yield tape
    finally:
        try:
            _call(endpoint, "stop-recording")
            tape.text = _call(endpoint, "download-recording", method="GET")
            _call(endpoint, "reset-recording")
        except (urllib.error.URLError, OSError) as exc:
            tape.why_not = f"the S3 server at {endpoint} did not hand back its recording ({_reason(exc)})"


def _reason(exc: BaseException) -> str:
    return str(getattr(exc, "reason", None) or getattr(exc, "code", None) or exc)[:200]


# --- judging what was recorded (pure) -------------------------------------------------------------------------

@dataclass
class RoleVerdict:
    """The check line of the role's enforcement, and what the JSON report carries."""

    title: str
    state: str  # ok | failed
    evidence: str
    report: dict[str, Any] = field(default_factory=dict)


def policy_partition(policy: Mapping[str, Any]) -> str:
    """The partition of the policy's ARNs (aws, aws-cn, aws-us-gov)."""
    arns = [str(r) for s in statements(policy) for r in listed(s.get("Resource", [])) if str(r).startswith("arn:")]
    return arns[0].split(":")[1] if arns else "aws"


def recorded_calls(tape: Tape, partition: str = "aws") -> list[S3Call]:
    host = urlsplit(tape.endpoint).netloc
    return [s3_call(entry, host, partition) for entry in recorded_requests(tape.text)]


def counts_line(calls: list[S3Call]) -> str:
    return ", ".join(f"{op} {n}" for op, n in operation_counts(calls)) or "none"


def role_verdict(policy: Mapping[str, Any] | None, tape: Tape, uses: int) -> RoleVerdict:
    """Whether the pods' role (its rendered `policy`; None: an existing role whose policy is not rendered) allows
    every request on the tape."""
    if tape.why_not:
        return RoleVerdict(f"the pods' S3 role covers the {uses} URI(s) of the RayJob (on paper)", "ok",
                           tape.why_not if policy else "not checked: the render holds no policy of the role (an "
                           "existing role_arn)", {"recorded": False, "why_not": tape.why_not})
    try:
        calls = recorded_calls(tape, policy_partition(policy) if policy else "aws")
    except ValueError as exc:  # a recording cut short: what it holds cannot be told apart
        return RoleVerdict("the pods' S3 role allows the S3 requests the job made", "failed",
                           f"the S3 server's recording does not read as requests ({exc})", {"recorded": False})
    report: dict[str, Any] = {"recorded": True, "operations": dict(operation_counts(calls))}
    if policy is None:
        return RoleVerdict(f"the {len(calls)} S3 requests the job and its Ray made (recorded)", "ok",
                           "not judged: the render holds no policy of the role (an existing role_arn); requests: "
                           + counts_line(calls), report)
    title = f"the pods' S3 role allows all {len(calls)} S3 requests the job and its Ray made (recorded, IAM's rules)"
    unknown = [c for c in calls if c.unknown]
    try:
        denied = denials(policy, calls)
    except PolicyError as exc:
        return RoleVerdict(title, "failed", f"the role's policy cannot be judged here: {exc}", report)
    report["denied"] = [denial_line(policy, d) for d in denied]
    report["unknown"] = [f"{c.operation} {c.where()}" for c in unknown]
    if denied:
        rest = Counter(d.call.operation for d in denied[1:]).most_common()
        more = f" (and {len(denied) - 1} more denied: {', '.join(f'{op} {n}' for op, n in rest)})" if rest else ""
        return RoleVerdict(title, "failed", report["denied"][0] + more, report)
    if unknown:
        return RoleVerdict(title, "failed", f"{report['unknown'][0]}: an S3 operation trainlift cannot map to "
                           "IAM actions, so the role's verdict on it is unknown", report)
    return RoleVerdict(title, "ok", f"requests: {counts_line(calls)}", report)
