"""Recorded S3 requests -> the S3 operation and what IAM authorises it as, and the pods' role's verdict on a real
recording (tests/fixtures/s3_recordings). Pure."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import yaml

from trainlift.ops.rehearse_s3 import Tape, policy_partition, recorded_calls, role_verdict
from trainlift.render.s3_requests import PYARROW_PROBE, recorded_requests, s3_call

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "s3_recordings"
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "reference"
HOST = "127.0.0.1:9000"
SIGNED = {"Host": HOST, "Authorization": "AWS4-HMAC-SHA256 Credential=AK/20261207/us-east-2/s3/aws4_request"}


def entry(method: str, path: str, body: str = "", **headers: str) -> dict:
    encoded = base64.b64encode(body.encode()).decode() if body else ""
    return {"method": method, "url": f"http://{HOST}{path}", "headers": {**SIGNED, **headers},
            "body": encoded, "body_encoded": bool(body)}


def checks(method: str, path: str, body: str = "", **headers: str) -> tuple[str, list[tuple[str, str, dict]]]:
    call = s3_call(entry(method, path, body, **headers), HOST)
    return call.operation, [(c.action, c.resource, {k: v[0] for k, v in c.context.items()
                                                    if k != "aws:securetransport"}) for c in call.checks]


B = "arn:aws:s3:::bkt"


@pytest.mark.parametrize("method, path, operation, action, resource, keys", [
    ("HEAD", "/bkt", "HeadBucket", "s3:ListBucket", B, {}),
    ("GET", "/bkt?list-type=2&max-keys=1000&prefix=runs%2Fx%2F", "ListObjectsV2", "s3:ListBucket", B,
     {"s3:prefix": "runs/x/", "s3:max-keys": "1000"}),
    ("GET", "/bkt?list-type=2&delimiter=%2F", "ListObjectsV2", "s3:ListBucket", B,
     {"s3:delimiter": "/", "s3:max-keys": "1000"}),
    ("GET", "/bkt?prefix=&max-keys=5", "ListObjects", "s3:ListBucket", B, {"s3:prefix": "", "s3:max-keys": "5"}),
    ("GET", "/bkt?location", "GetBucketLocation", "s3:GetBucketLocation", B, {}),
    ("GET", "/bkt?uploads", "ListMultipartUploads", "s3:ListBucketMultipartUploads", B, {}),
    ("GET", "/bkt/runs/a.json", "GetObject", "s3:GetObject", B + "/runs/a.json", {}),
    ("GET", "/bkt/runs/a.json?versionId=v1", "GetObject", "s3:GetObjectVersion", B + "/runs/a.json",
     {"s3:versionid": "v1"}),
    ("HEAD", "/bkt/runs/a%20b.json", "HeadObject", "s3:GetObject", B + "/runs/a b.json", {}),
    ("PUT", "/bkt/runs/", "PutObject", "s3:PutObject", B + "/runs/", {}),
    ("POST", "/bkt/runs/ckpt/0.distcp?uploads", "CreateMultipartUpload", "s3:PutObject", B + "/runs/ckpt/0.distcp", {}),
    ("PUT", "/bkt/runs/ckpt/0.distcp?partNumber=1&uploadId=u", "UploadPart", "s3:PutObject", B + "/runs/ckpt/0.distcp", {}),
    ("POST", "/bkt/runs/ckpt/0.distcp?uploadId=u", "CompleteMultipartUpload", "s3:PutObject", B + "/runs/ckpt/0.distcp", {}),
    ("DELETE", "/bkt/runs/ckpt/0.distcp?uploadId=u", "AbortMultipartUpload", "s3:AbortMultipartUpload",
     B + "/runs/ckpt/0.distcp", {}),
    ("GET", "/bkt/runs/ckpt/0.distcp?uploadId=u", "ListParts", "s3:ListMultipartUploadParts", B + "/runs/ckpt/0.distcp", {}),
    ("DELETE", "/bkt/runs/old.json", "DeleteObject", "s3:DeleteObject", B + "/runs/old.json", {}),
    ("GET", "/bkt/runs/a.json?x-id=GetObject", "GetObject", "s3:GetObject", B + "/runs/a.json", {}),
])
def test_each_operation_is_the_iam_action_s3_authorises(method, path, operation, action, resource, keys):
    assert checks(method, path) == (operation, [(action, resource, keys)])


def test_delete_objects_is_a_delete_of_each_key_in_its_body():
    body = ("<Delete><Object><Key>runs/a&amp;b</Key></Object><Object><Key>runs/c</Key><VersionId>v</VersionId>"
            "</Object><Quiet>true</Quiet></Delete>")
    assert checks("POST", "/bkt?delete", body) == ("DeleteObjects", [
        ("s3:DeleteObject", B + "/runs/a&b", {}), ("s3:DeleteObjectVersion", B + "/runs/c", {})])


def test_a_copy_needs_get_on_the_source_and_headers_add_their_actions_and_keys():
    operation, found = checks("PUT", "/bkt/runs/b.json", **{"x-amz-copy-source": "/bkt/code/a.json",
                                                            "x-amz-acl": "private", "x-amz-tagging": "k=v"})
    keys = {"s3:x-amz-copy-source": "/bkt/code/a.json", "s3:x-amz-acl": "private"}
    assert operation == "PutObject" and found == [
        ("s3:PutObject", B + "/runs/b.json", keys), ("s3:PutObjectTagging", B + "/runs/b.json", keys),
        ("s3:PutObjectAcl", B + "/runs/b.json", keys), ("s3:GetObject", B + "/code/a.json", keys)]


def test_a_virtual_hosted_request_names_its_bucket_in_the_host():
    call = s3_call({"method": "HEAD", "url": f"http://bkt.{HOST}/", "headers": {**SIGNED, "Host": f"bkt.{HOST}"}},
                   HOST)
    assert (call.operation, call.bucket, call.checks[0].resource) == ("HeadBucket", "bkt", B)


def test_pyarrows_probe_of_an_invalid_bucket_name_is_counted_not_judged_and_unknown_operations_are_said():
    probe = s3_call(entry("HEAD", "/%24extremelyunlikelytoexist%24"), HOST)
    assert (probe.operation, probe.checks, probe.unjudged) == ("HeadBucket", (), PYARROW_PROBE)
    odd = s3_call(entry("PUT", "/bkt?website"), HOST)
    assert odd.unknown and odd.operation == "PUT bucket ?website" and odd.checks == ()


def test_another_services_request_is_named_by_its_signing_scope():
    call = s3_call({"method": "POST", "url": f"http://{HOST}/?Action=GetCallerIdentity",
                    "headers": {"Authorization": "AWS4-HMAC-SHA256 Credential=AK/20261207/us-east-1/sts/aws4_request"}},
                   HOST)
    assert call.checks[0].action == "sts:GetCallerIdentity"


def test_a_recording_whose_lines_were_interleaved_by_threads_still_reads():
    one, two = json.dumps(entry("HEAD", "/bkt")), json.dumps(entry("GET", "/bkt/k"))
    assert [e["method"] for e in recorded_requests(f"{one}{two}\n\n{one}\n")] == ["HEAD", "GET", "HEAD"]


# --- the reference rehearsal's real requests against the reference render's role ------------------------------

OLD_LISTING = {"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": "arn:aws:s3:::my-trainlift-checkpoints",
               "Condition": {"StringLike": {"s3:prefix": ["ray-train", "ray-train/*", "code", "code/*"]}}}


def reference_policy() -> dict:
    return yaml.safe_load((GOLDEN / "eksctl.yaml").read_text())["iam"]["serviceAccounts"][0]["attachPolicy"]


def reference_tape() -> Tape:
    return Tape(f"http://{HOST}", (FIXTURES / "reference-rehearsal.jsonl").read_text())


def test_the_rendered_role_allows_every_request_of_the_reference_rehearsal():
    verdict = role_verdict(reference_policy(), reference_tape(), 3)
    assert verdict.state == "ok", verdict.evidence
    assert verdict.report["operations"]["HeadBucket"] >= 1 and verdict.report["denied"] == []


def test_the_prefix_conditioned_listing_trainlift_rendered_before_denies_headbucket_in_one_line():
    """apache/arrow#49949: pyarrow's create_dir sends HeadBucket, which S3 authorises as s3:ListBucket without
    s3:prefix; the role rendered before allowed ListBucket only with an s3:prefix condition."""
    old = reference_policy()
    old["Statement"][1] = OLD_LISTING
    verdict = role_verdict(old, reference_tape(), 3)
    assert verdict.state == "failed" and "\n" not in verdict.evidence
    assert verdict.evidence.startswith(
        "HeadBucket s3://my-trainlift-checkpoints needs s3:ListBucket on arn:aws:s3:::my-trainlift-checkpoints: no "
        "statement of the role allows it (statement 2 allows it only with StringLike s3:prefix ['ray-train', "
        "'ray-train/*', 'code', 'code/*'], and the request has no s3:prefix); missing: {\"Effect\": \"Allow\", "
        "\"Action\": \"s3:ListBucket\", \"Resource\": \"arn:aws:s3:::my-trainlift-checkpoints\"}")
    assert {line.split(" ")[0] for line in verdict.report["denied"]} == {"HeadBucket"}
    assert verdict.evidence.endswith("(and 8 more denied: HeadBucket 8)")  # 13 sent, 4 of them pyarrow's probe


def test_a_partitions_role_is_judged_with_its_own_arns():
    china = json.loads(json.dumps(reference_policy()).replace('"arn:aws:', '"arn:aws-cn:'))
    assert policy_partition(china) == "aws-cn"
    assert role_verdict(china, reference_tape(), 3).state == "ok"
    calls = recorded_calls(reference_tape(), "aws-cn")
    assert all(c.resource.startswith("arn:aws-cn:s3:::") for call in calls for c in call.checks)


def test_without_a_recording_the_check_says_why_and_what_it_rests_on():
    why = "the S3 server at http://x keeps no request recording (404); moto_server does"
    verdict = role_verdict(reference_policy(), Tape("http://x", why_not=why), 3)
    assert (verdict.state, verdict.evidence, verdict.report["recorded"]) == ("ok", why, False)
    assert "on paper" in verdict.title


def test_an_existing_roles_requests_are_counted_unknown_operations_and_unjudgeable_policies_fail():
    from trainlift.ops.rehearse_s3 import recording

    counted = role_verdict(None, reference_tape(), 3)
    assert counted.state == "ok" and "not judged" in counted.evidence and "HeadBucket 13" in counted.evidence
    odd = Tape(f"http://{HOST}", json.dumps(entry("PUT", "/bkt?website")))
    assert role_verdict(reference_policy(), odd, 1).evidence.startswith("PUT bucket ?website s3://bkt: an S3 "
                                                                        "operation trainlift cannot map")
    by_ip = {"Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*",
                            "Condition": {"IpAddress": {"aws:SourceIp": "10.0.0.0/8"}}}]}
    verdict = role_verdict(by_ip, reference_tape(), 3)
    assert verdict.state == "failed" and "IpAddress is not modelled" in verdict.evidence
    with recording("") as tape:  # AWS's own S3: nothing to record, and the check says so
        pass
    assert "AWS's own" in tape.why_not and role_verdict(reference_policy(), tape, 3).state == "ok"
