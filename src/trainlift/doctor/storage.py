"""A job's run storage, judged from what each node's probe met (pure: storage_probe.py makes the requests).

`doctor --storage s3://bucket/prefix` (or a `--job` whose run.storage is on S3) names it in every node's
environment; each node's probe asks S3 with that node's own credentials, and `storage_findings` gives one finding
per refused request, naming the permission the role lacks.
"""

from __future__ import annotations

from typing import Any

from trainlift.doctor.probe import Facts
from trainlift.doctor.rules import Finding
from trainlift.doctor.storage_probe import ENV_VAR

RULE = "storage_access"
DENIED = {"403", "AccessDenied", "Forbidden", "AllAccessDisabled"}
MISSING_BUCKET = {"404", "NoSuchBucket", "NotFound"}
HEAD_BUCKET_FIX = ("allow s3:ListBucket on {resource} with no s3:prefix condition: pyarrow's create_dir (trainlift's "
                   "writes, Ray Train's storage setup) sends HeadBucket first, and S3 authorises it as a bucket-wide "
                   "listing; trainlift render's role does (docs/security.md says what it exposes)")


def storage_env(uri: str | None) -> dict[str, str]:
    """What every node's probe needs to look at the run storage: its URI, never a credential."""
    return {ENV_VAR: uri} if uri else {}


def _fix(call: dict[str, Any]) -> str:
    if call["permission"] == "s3:ListBucket":
        return HEAD_BUCKET_FIX.format(resource=call["resource"])
    folder = call["resource"].rsplit("/", 2)[0] + "/*"
    left = (f"; the probe object {call['resource'].partition(':::')[2]} is left behind: delete it"
            if call["permission"] == "s3:DeleteObject" else "")
    return (f"allow {call['permission']} on {folder} in the pods' role (trainlift render grants it under "
            f"storage.s3.uri; an existing role_arn is yours to extend){left}")


def _finding(uri: str, call: dict[str, Any], node: str | None) -> Finding:
    said = f"{call['call']} on {uri}"
    code = str(call.get("code"))
    if code == "unreachable":
        return Finding(RULE, "error", f"{said}: S3 does not answer ({call['message']})",
                       "check the node's route to S3 (VPC endpoint or NAT) and AWS_ENDPOINT_URL", node)
    if code == "no_credentials":
        return Finding(RULE, "error", f"{said}: no AWS credentials on this node",
                       "give the pods a service account with an IAM role (storage.s3 in the cluster spec)", node)
    if call["call"] == "HeadBucket" and code in MISSING_BUCKET:
        return Finding(RULE, "error", f"{said}: the bucket does not exist",
                       "create it, or point run.storage at your bucket", node)
    if code in DENIED:
        return Finding(RULE, "error", f"{said}: access denied: the role lacks {call['permission']} on "
                       f"{call['resource']}", _fix(call), node)
    return Finding(RULE, "error", f"{said}: {code}: {call['message']}", "", node)


def storage_findings(facts: Facts, node: str | None = None) -> list[Finding]:
    """One finding per request S3 refused, naming the missing permission; one ok when all four were answered."""
    storage = facts.storage
    if storage is None:
        return []
    failed = [c for c in storage["calls"] if not c["ok"]]
    if failed:
        return [_finding(storage["uri"], c, node) for c in failed]
    return [Finding(RULE, "ok", f"run storage {storage['uri']}: HeadBucket, and a put, get and delete under it, "
                    "answered with this node's credentials", node=node)]
