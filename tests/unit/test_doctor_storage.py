"""The run storage probe's facts, judged: one finding per refused request, naming the permission. Pure."""

from __future__ import annotations

from trainlift.doctor.probe import Facts
from trainlift.doctor.storage import storage_env, storage_findings
from trainlift.doctor.storage_probe import ENV_VAR, partition_of, probe_key, storage_access

ARN = "arn:aws:s3:::bkt"
KEY = "runs/.trainlift-doctor/node-1a2b3c4d"


def call(name: str, permission: str, ok: bool, code: str | None = None, status: int | None = None) -> dict:
    resource = ARN if name == "HeadBucket" else f"{ARN}/{KEY}"
    return {"call": name, "permission": permission, "resource": resource, "ok": ok, "code": code, "status": status,
            "message": "Forbidden" if code else ""}


def facts(*calls: dict) -> Facts:
    return Facts(storage={"uri": "s3://bkt/runs", "key": KEY, "calls": list(calls)})


def test_a_listing_conditioned_on_a_prefix_is_named_with_the_fix():
    found = storage_findings(facts(call("HeadBucket", "s3:ListBucket", False, "403", 403),
                                   call("PutObject", "s3:PutObject", True), call("GetObject", "s3:GetObject", True),
                                   call("DeleteObject", "s3:DeleteObject", True)), node="10.0.0.5/abc (head)")
    [head] = found
    assert (head.severity, head.node) == ("error", "10.0.0.5/abc (head)")
    assert head.message == "HeadBucket on s3://bkt/runs: access denied: the role lacks s3:ListBucket on arn:aws:s3:::bkt"
    assert head.fix.startswith("allow s3:ListBucket on arn:aws:s3:::bkt with no s3:prefix condition")


def test_one_finding_per_refusal_and_an_unreachable_s3_or_a_missing_bucket_is_said_so():
    found = storage_findings(facts(call("HeadBucket", "s3:ListBucket", True),
                                   call("PutObject", "s3:PutObject", False, "AccessDenied", 403),
                                   call("DeleteObject", "s3:DeleteObject", False, "AccessDenied", 403)))
    assert [f.message.split(": ")[-1] for f in found] == [
        f"the role lacks s3:PutObject on {ARN}/{KEY}", f"the role lacks s3:DeleteObject on {ARN}/{KEY}"]
    assert found[0].fix.startswith(f"allow s3:PutObject on {ARN}/runs/* in the pods' role")
    [gone] = storage_findings(facts(call("HeadBucket", "s3:ListBucket", False, "404", 404)))
    assert gone.message.endswith("the bucket does not exist")
    [away] = storage_findings(facts(call("HeadBucket", "s3:ListBucket", False, "unreachable")))
    assert "S3 does not answer" in away.message
    assert storage_findings(Facts()) == []
    [ok] = storage_findings(facts(*(call(n, p, True) for n, p in (("HeadBucket", "s3:ListBucket"),
                                                                  ("PutObject", "s3:PutObject")))))
    assert ok.severity == "ok"


def test_the_probe_is_named_in_every_nodes_environment_and_writes_only_under_its_own_folder():
    assert storage_env("s3://bkt/runs") == {ENV_VAR: "s3://bkt/runs"} and storage_env(None) == {}
    assert storage_access({}) is None and storage_access({ENV_VAR: "runs/"}) is None
    assert probe_key("runs").startswith("runs/.trainlift-doctor/") and probe_key("").startswith(".trainlift-doctor/")
    assert (partition_of("cn-north-1"), partition_of("us-gov-west-1"), partition_of(None)) == (
        "aws-cn", "aws-us-gov", "aws")
