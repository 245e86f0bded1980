"""Whether this machine's own credentials (on a pod: its service account's role) may use a job's run storage the
way the job does: HeadBucket (pyarrow's create_dir, which trainlift's writes and Ray Train's storage setup call,
sends it first; S3 authorises it as s3:ListBucket), then a put, a get and a delete of a probe object under the
run prefix. Four S3 requests with boto3, each answered as S3 would answer the job; a refusal is a fact here, never
an exception. Node side: the image has boto3; trainlift's cloud/ is the user's machine's and is not imported.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any, Callable, Mapping

ENV_VAR = "TRAINLIFT_DOCTOR_STORAGE"
PROBE_FOLDER = ".trainlift-doctor"
PROBE_BODY = b"trainlift doctor: storage probe, deleted after reading\n"
CONNECT_TIMEOUT_S, READ_TIMEOUT_S = 5, 10


def split_uri(uri: str) -> tuple[str, str]:
    """s3://bucket/a/b/ -> ("bucket", "a/b")."""
    bucket, _, key = uri[len("s3://"):].partition("/")
    return bucket, key.strip("/")


def partition_of(region: str | None) -> str:
    region = region or ""
    return "aws-cn" if region.startswith("cn-") else "aws-us-gov" if region.startswith("us-gov-") else "aws"


def probe_key(prefix: str) -> str:
    """A key of this machine's own under the run prefix: no other node's probe, nor a run, is touched."""
    name = f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
    return f"{prefix}/{PROBE_FOLDER}/{name}" if prefix else f"{PROBE_FOLDER}/{name}"


def _client(environ: Mapping[str, str]) -> Any:
    import boto3
    from botocore.config import Config

    config = Config(connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S,
                    retries={"total_max_attempts": 2, "mode": "standard"})
    region = environ.get("AWS_REGION") or environ.get("AWS_DEFAULT_REGION") or None
    return boto3.session.Session(region_name=region).client("s3", config=config)


def _attempt(call: Callable[[], Any]) -> dict[str, Any]:
    """{"ok": True}, or {"ok": False, "code", "status", "message"}; "unreachable" / "no_credentials" as codes."""
    from botocore import exceptions as bce

    try:
        call()
        return {"ok": True}
    except bce.ClientError as exc:
        error, meta = exc.response.get("Error", {}), exc.response.get("ResponseMetadata", {})
        return {"ok": False, "code": str(error.get("Code") or meta.get("HTTPStatusCode") or "error"),
                "status": meta.get("HTTPStatusCode"), "message": _line(error.get("Message") or str(exc))}
    except (bce.NoCredentialsError, bce.PartialCredentialsError) as exc:
        return {"ok": False, "code": "no_credentials", "status": None, "message": _line(str(exc))}
    except (bce.EndpointConnectionError, bce.ConnectTimeoutError, bce.ReadTimeoutError, bce.HTTPClientError) as exc:
        return {"ok": False, "code": "unreachable", "status": None, "message": _line(str(exc))}
    except bce.BotoCoreError as exc:
        return {"ok": False, "code": type(exc).__name__, "status": None, "message": _line(str(exc))}


def _line(text: str) -> str:
    return " ".join(str(text).split())[:300]


def storage_access(environ: Mapping[str, str] = os.environ) -> dict[str, Any] | None:
    """{uri, key, calls: [{call, permission, resource, ok, code, status, message}]}; None when no storage is named.
    A call after an unreachable endpoint or missing credentials is not made; the get is not made when nothing was
    put (there would be nothing to read)."""
    uri = environ.get(ENV_VAR, "")
    if not uri.startswith("s3://"):
        return None
    bucket, prefix = split_uri(uri)
    key = probe_key(prefix)
    arn = f"arn:{partition_of(environ.get('AWS_REGION') or environ.get('AWS_DEFAULT_REGION'))}:s3:::{bucket}"
    facts: dict[str, Any] = {"uri": uri, "key": key, "calls": []}
    try:
        s3 = _client(environ)
    except Exception as exc:  # noqa: BLE001 - boto3 missing or a broken AWS configuration: a fact, not a crash
        facts["calls"].append({"call": "client", "permission": "", "resource": arn, "ok": False,
                               "code": type(exc).__name__, "status": None, "message": _line(str(exc))})
        return facts
    steps = (("HeadBucket", "s3:ListBucket", arn, lambda: s3.head_bucket(Bucket=bucket)),
             ("PutObject", "s3:PutObject", f"{arn}/{key}", lambda: s3.put_object(Bucket=bucket, Key=key, Body=PROBE_BODY)),
             ("GetObject", "s3:GetObject", f"{arn}/{key}",
              lambda: s3.get_object(Bucket=bucket, Key=key)["Body"].read()),
             ("DeleteObject", "s3:DeleteObject", f"{arn}/{key}", lambda: s3.delete_object(Bucket=bucket, Key=key)))
    for name, permission, resource, call in steps:
        if name == "GetObject" and not facts["calls"][-1]["ok"]:
            continue
        facts["calls"].append({"call": name, "permission": permission, "resource": resource, **_attempt(call)})
        if facts["calls"][-1].get("code") in ("unreachable", "no_credentials"):
            break
    return facts
