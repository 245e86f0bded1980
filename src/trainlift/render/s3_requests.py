"""S3 requests as IAM authorises them, and a role's verdict on each. Pure.

A recorded HTTP request (method, URL, headers, body: what moto's request recorder keeps) becomes its S3 operation
and the IAM requests S3 checks for it: the action, the resource ARN and the condition keys the request carries.
The mapping is the one the Amazon S3 API Reference gives under each operation's "Permissions" and the Service
Authorization Reference's "Actions, resources, and condition keys for Amazon S3": HeadBucket is s3:ListBucket on
the bucket with no s3:prefix; ListObjects(V2) is s3:ListBucket with s3:prefix (when the request names one),
s3:delimiter and s3:max-keys (always present, 1000 when not given); GetObject and HeadObject are s3:GetObject
(s3:GetObjectVersion with a versionId); PutObject and the multipart upload calls are s3:PutObject, plus
s3:PutObjectTagging with a tagging header and s3:PutObjectAcl with an ACL header; CopyObject and UploadPartCopy
also need s3:GetObject on the source; DeleteObjects is s3:DeleteObject on each key in its body;
AbortMultipartUpload, ListMultipartUploads, ListParts have actions of their own. Requests are taken as the pods
send them to S3: over HTTPS (aws:SecureTransport true). A request to a name that is not a valid bucket name
involves no bucket of the role's (pyarrow sends one, expecting an error, to learn which S3 implementation
answers): it is counted, not judged. An operation the table does not know is reported as such, never guessed.
"""

from __future__ import annotations

import base64
import html
import json
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping
from urllib.parse import parse_qsl, unquote, urlsplit

from trainlift.render.iam_eval import Decision, Request, evaluate, make_request, statement_name

_BUCKET_OPS = {
    ("HEAD", ""): ("HeadBucket", "s3:ListBucket"), ("GET", ""): ("ListObjects", "s3:ListBucket"),
    ("GET", "list-type"): ("ListObjectsV2", "s3:ListBucket"),
    ("GET", "versions"): ("ListObjectVersions", "s3:ListBucketVersions"),
    ("GET", "uploads"): ("ListMultipartUploads", "s3:ListBucketMultipartUploads"),
    ("GET", "location"): ("GetBucketLocation", "s3:GetBucketLocation"),
    ("GET", "versioning"): ("GetBucketVersioning", "s3:GetBucketVersioning"),
    ("GET", "policy"): ("GetBucketPolicy", "s3:GetBucketPolicy"), ("GET", "acl"): ("GetBucketAcl", "s3:GetBucketAcl"),
    ("GET", "tagging"): ("GetBucketTagging", "s3:GetBucketTagging"),
    ("GET", "encryption"): ("GetBucketEncryption", "s3:GetEncryptionConfiguration"),
    ("GET", "lifecycle"): ("GetBucketLifecycleConfiguration", "s3:GetLifecycleConfiguration"),
    ("PUT", ""): ("CreateBucket", "s3:CreateBucket"), ("DELETE", ""): ("DeleteBucket", "s3:DeleteBucket"),
    ("PUT", "policy"): ("PutBucketPolicy", "s3:PutBucketPolicy"),
    ("PUT", "versioning"): ("PutBucketVersioning", "s3:PutBucketVersioning"),
    ("PUT", "tagging"): ("PutBucketTagging", "s3:PutBucketTagging"),
    ("DELETE", "policy"): ("DeleteBucketPolicy", "s3:DeleteBucketPolicy"),
    ("POST", "delete"): ("DeleteObjects", "s3:DeleteObject"),
}
_OBJECT_OPS = {
    ("GET", ""): ("GetObject", "s3:GetObject"), ("HEAD", ""): ("HeadObject", "s3:GetObject"),
    ("PUT", ""): ("PutObject", "s3:PutObject"), ("DELETE", ""): ("DeleteObject", "s3:DeleteObject"),
    ("POST", "uploads"): ("CreateMultipartUpload", "s3:PutObject"), ("PUT", "uploadId"): ("UploadPart", "s3:PutObject"),
    ("POST", "uploadId"): ("CompleteMultipartUpload", "s3:PutObject"),
    ("DELETE", "uploadId"): ("AbortMultipartUpload", "s3:AbortMultipartUpload"),
    ("GET", "uploadId"): ("ListParts", "s3:ListMultipartUploadParts"),
    ("GET", "acl"): ("GetObjectAcl", "s3:GetObjectAcl"), ("PUT", "acl"): ("PutObjectAcl", "s3:PutObjectAcl"),
    ("GET", "tagging"): ("GetObjectTagging", "s3:GetObjectTagging"),
    ("PUT", "tagging"): ("PutObjectTagging", "s3:PutObjectTagging"),
    ("DELETE", "tagging"): ("DeleteObjectTagging", "s3:DeleteObjectTagging"),
    ("GET", "attributes"): ("GetObjectAttributes", "s3:GetObjectAttributes"),
    ("POST", "restore"): ("RestoreObject", "s3:RestoreObject"), ("POST", "select"): ("SelectObjectContent", "s3:GetObject"),
}
_VERSIONED = {"s3:GetObject": "s3:GetObjectVersion", "s3:DeleteObject": "s3:DeleteObjectVersion",
              "s3:GetObjectAcl": "s3:GetObjectVersionAcl", "s3:GetObjectTagging": "s3:GetObjectVersionTagging",
              "s3:PutObjectTagging": "s3:PutObjectVersionTagging", "s3:PutObjectAcl": "s3:PutObjectVersionAcl",
              "s3:DeleteObjectTagging": "s3:DeleteObjectVersionTagging",
              "s3:GetObjectAttributes": "s3:GetObjectVersionAttributes"}
# Query parameters that are arguments, not the subresource that names an operation.
_ARGUMENTS = {"prefix", "delimiter", "max-keys", "marker", "continuation-token", "start-after", "encoding-type",
              "fetch-owner", "versionid", "partnumber", "x-id", "max-uploads", "key-marker", "upload-id-marker",
              "version-id-marker", "max-parts", "part-number-marker"}
_LISTS = {"ListObjects", "ListObjectsV2", "ListObjectVersions"}
_HEADER_KEYS = ("x-amz-acl", "x-amz-copy-source", "x-amz-grant-full-control", "x-amz-grant-read",
                "x-amz-grant-read-acp", "x-amz-grant-write", "x-amz-grant-write-acp", "x-amz-metadata-directive",
                "x-amz-server-side-encryption", "x-amz-server-side-encryption-aws-kms-key-id",
                "x-amz-storage-class", "x-amz-object-lock-mode", "x-amz-object-lock-legal-hold")
_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_SERVICE = re.compile(r"Credential=[^/,]+/\d{8}/[^/]+/([^/]+)/aws4_request")
PYARROW_PROBE = ("not a valid bucket name: pyarrow sends it expecting an error, to learn which S3 implementation "
                 "answers; no bucket of the role's is involved")


@dataclass(frozen=True)
class S3Call:
    """One recorded request: its operation, where, and what S3 authorises it as (`checks`)."""

    operation: str
    bucket: str
    key: str
    query: tuple[tuple[str, str], ...]
    checks: tuple[Request, ...]
    unjudged: str = ""  # why no IAM check applies (`checks` is empty then)
    unknown: bool = False  # an operation this module does not map: it cannot be judged

    def where(self) -> str:
        shown = [f"{k}={v}" if v else k for k, v in self.query if k.lower() in ("prefix", "delimiter")]
        return f"s3://{self.bucket}" + (f"/{self.key}" if self.key else "") + (f"?{'&'.join(shown)}" if shown else "")


def recorded_requests(text: str) -> list[dict[str, Any]]:
    """The JSON objects of a recording, one after another (lines written by concurrent threads may share a line)."""
    decoder, out, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at >= len(text):
            return out
        entry, at = decoder.raw_decode(text, at)
        out.append(entry)


def _header(headers: Mapping[str, str], name: str) -> str | None:
    return next((v for k, v in headers.items() if k.lower() == name), None)


def _target(url: str, headers: Mapping[str, str], endpoint_host: str) -> tuple[str, str, list[tuple[str, str]]]:
    """(bucket, key, query) of a path-style or virtual-hosted request to the endpoint `endpoint_host`."""
    parts = urlsplit(url)
    host = (_header(headers, "host") or parts.netloc).lower()
    query = parse_qsl(parts.query, keep_blank_values=True)
    path = unquote(parts.path.lstrip("/"))
    if endpoint_host and host != endpoint_host.lower() and host.endswith("." + endpoint_host.lower()):
        return host[: -len(endpoint_host) - 1], path, query
    bucket, _, key = path.partition("/")
    return bucket, key, query


def _service(headers: Mapping[str, str], query: Mapping[str, str]) -> str | None:
    """The service a SigV4 request is signed for: from its Authorization header, or a presigned URL's credential."""
    if found := _SERVICE.search(_header(headers, "authorization") or ""):
        return found.group(1)
    scope = query.get("X-Amz-Credential", "").split("/")  # key/date/region/service/aws4_request
    return scope[3] if len(scope) == 5 else None


def _subresource(query: list[tuple[str, str]]) -> str:
    """The query parameter that names the operation ("" for none); `uploadId` wins (a part upload has both)."""
    names = [k for k, _ in query if k.lower() not in _ARGUMENTS and not k.lower().startswith(("x-amz-", "response-"))]
    if any(k == "uploadId" for k, _ in query):
        return "uploadId"
    return names[0] if names else ""


def _context(operation: str, query: Mapping[str, str], headers: Mapping[str, str]) -> dict[str, str]:
    keys = {"aws:SecureTransport": "true"}
    if operation in _LISTS:
        keys.update({f"s3:{k}": query[k] for k in ("prefix", "delimiter") if k in query})
        keys["s3:max-keys"] = query.get("max-keys", "1000")
    keys.update({f"s3:{h}": v for h in _HEADER_KEYS if (v := _header(headers, h)) is not None})
    if "versionId" in query:
        keys["s3:VersionId"] = query["versionId"]
    return keys


def _deleted_keys(body: str) -> list[tuple[str, bool]]:
    """(key, versioned) of each object a DeleteObjects body names."""
    objects = re.findall(r"<Object>(.*?)</Object>", body, re.DOTALL)
    return [(html.unescape(m.group(1)), "<VersionId>" in o) for o in objects
            if (m := re.search(r"<Key>(.*?)</Key>", o, re.DOTALL))]


def _body(entry: Mapping[str, Any]) -> str:
    raw = entry.get("body") or ""
    return base64.b64decode(raw).decode("utf-8", "replace") if entry.get("body_encoded") else str(raw)


def _object_checks(action: str, arn: str, keys: dict[str, str], headers: Mapping[str, str]) -> list[Request]:
    checks = [make_request(_VERSIONED.get(action, action) if "s3:VersionId" in keys else action, arn, keys)]
    if action == "s3:PutObject" and _header(headers, "x-amz-tagging"):
        checks.append(make_request("s3:PutObjectTagging", arn, keys))
    if action == "s3:PutObject" and any(_header(headers, h) for h in _HEADER_KEYS if "-grant-" in h or h.endswith("-acl")):
        checks.append(make_request("s3:PutObjectAcl", arn, keys))
    if source := _header(headers, "x-amz-copy-source"):
        path, _, version = unquote(source).lstrip("/").partition("?versionId=")
        checks.append(make_request("s3:GetObjectVersion" if version else "s3:GetObject",
                                   f"{arn.split(':::')[0]}:::{path}", keys))
    return checks


def s3_call(entry: Mapping[str, Any], endpoint_host: str = "", partition: str = "aws") -> S3Call:
    """The S3 operation of one recorded request and the IAM requests S3 authorises it as."""
    headers = entry.get("headers") or {}
    bucket, key, pairs = _target(str(entry.get("url", "")), headers, endpoint_host)
    query, method, sub = dict(pairs), str(entry.get("method", "")).upper(), _subresource(pairs)
    service = _service(headers, query)
    if service not in (None, "s3"):
        name = _header(headers, "x-amz-target") or query.get("Action") or "request"
        action = f"{service}:{name.rpartition('.')[2]}"
        return S3Call(action, "", "", tuple(pairs), (make_request(action, "*"),))
    if not bucket:
        return S3Call("ListBuckets", "", "", tuple(pairs), (make_request("s3:ListAllMyBuckets", "*"),))
    if not _BUCKET_NAME.match(bucket):
        return S3Call("HeadBucket" if method == "HEAD" else method, bucket, key, tuple(pairs), (), PYARROW_PROBE)
    known = (_OBJECT_OPS if key else _BUCKET_OPS).get((method, sub))
    if known is None:
        name = f"{method} {'object' if key else 'bucket'}" + (f" ?{sub}" if sub else "")
        return S3Call(name, bucket, key, tuple(pairs), (), "an S3 operation trainlift does not map", unknown=True)
    operation, action = known
    keys = _context(operation, query, headers)
    arn = f"arn:{partition}:s3:::{bucket}"
    if operation == "DeleteObjects":
        checks = [make_request(_VERSIONED[action] if versioned else action, f"{arn}/{k}", keys)
                  for k, versioned in _deleted_keys(_body(entry))]
    elif key:
        checks = _object_checks(action, f"{arn}/{key}", keys, headers)
    else:
        checks = [make_request(action, arn, keys)]
    return S3Call(operation, bucket, key, tuple(pairs), tuple(checks))


# --- a role's verdict -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Denial:
    call: S3Call
    check: Request
    decision: Decision


def denials(policy: Mapping[str, Any], calls: list[S3Call]) -> list[Denial]:
    """Every IAM request of `calls` that `policy` does not allow, in the order made."""
    return [Denial(call, check, decision) for call in calls for check in call.checks
            if not (decision := evaluate(policy, check)).allowed]


def operation_counts(calls: list[S3Call]) -> list[tuple[str, int]]:
    """How many calls of each operation, most first."""
    return Counter(call.operation for call in calls).most_common()


def missing_statement(check: Request) -> dict[str, str]:
    """The least statement that would allow `check`: its action on its resource, with no condition."""
    return {"Effect": "Allow", "Action": check.action, "Resource": check.resource}


def denial_line(policy: Mapping[str, Any], denial: Denial) -> str:
    """One line: the call, its key, why the role denies it and the statement that is missing."""
    check, decision = denial.check, denial.decision
    head = f"{denial.call.operation} {denial.call.where()} needs {check.action} on {check.resource}"
    if decision.effect == "Deny":
        return f"{head}: explicitly denied by the role's {statement_name(policy, int(decision.statement or 0))}"
    why = f" ({decision.near[0]})" if decision.near else ""
    return f"{head}: no statement of the role allows it{why}; missing: {json.dumps(missing_statement(check))}"
