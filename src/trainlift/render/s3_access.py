"""What the pods' S3 role may touch: the IAM policy eksctl attaches, and the check that a job stays inside it. Pure.

The role (IRSA, rendered in eksctl.yaml) may read and write under `storage.s3.uri` and
read under each `storage.s3.read` location, nothing else; it may list the key names of the storage bucket (S3
authorises HeadBucket, which every write path sends first, as a bucket-wide listing). `s3_access_problems` finds
every S3 URI a job uses that the role does not cover, so render and submit refuse it
before anything starts. An existing role (`storage.s3.role_arn`) is the user's: its
policy is not visible here, so nothing is checked against it, except that code (the
RayJob's working_dir and py_modules zips) never lies under `uri`, which the pods write.
`location_problems` refuses locations that would widen the policy: a wildcard or a `..`
segment (IAM and S3 take both literally), or a whole bucket without `allow_whole_bucket`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from trainlift.config.cluster import ClusterSpec, S3Storage
from trainlift.config.job import JobSpec
from trainlift.render.problems import Problem, raise_problems

READ_WRITE = ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"]


@dataclass(frozen=True)
class S3Use:
    """One S3 URI a job reads (or writes, for its run storage), named by the field it came from."""

    field: str
    uri: str
    write: bool = False
    code: bool = False  # code every node runs (runtime_env zips): read-only, never where the pods may write


@dataclass(frozen=True)
class Grant:
    bucket: str
    prefix: str  # "" is the whole bucket
    write: bool

    def covers(self, bucket: str, key: str) -> bool:
        return bucket == self.bucket and (not self.prefix or key == self.prefix or key.startswith(self.prefix + "/"))

    def uri(self) -> str:
        return f"s3://{self.bucket}/" + (f"{self.prefix}/" if self.prefix else "")


def split_s3(uri: str) -> tuple[str, str]:
    """s3://bucket/a/b/ -> ("bucket", "a/b")."""
    bucket, _, key = uri[len("s3://"):].partition("/")
    return bucket, key.strip("/")


def role_grants(s3: S3Storage) -> list[Grant]:
    """What the rendered role allows: read-write on the storage prefix, read-only on each `read` location."""
    return [Grant(s3.bucket, s3.prefix, True)] + [Grant(*split_s3(uri), False) for uri in s3.read]


def _partition(region: str) -> str:
    if region.startswith("cn-"):
        return "aws-cn"
    return "aws-us-gov" if region.startswith("us-gov-") else "aws"


def _one_or_many(items: list[str]) -> str | list[str]:
    return items[0] if len(items) == 1 else items


def s3_policy(s3: S3Storage, region: str) -> dict[str, Any]:
    """Least privilege: read, write and delete under the storage prefix, and read the `read` locations.

    Listing: the storage bucket's `s3:ListBucket` has no `s3:prefix` condition. Writing there starts with pyarrow's
    `create_dir`, which sends HeadBucket, and S3 authorises HeadBucket as `s3:ListBucket` with no `s3:prefix` in
    the request: a prefix condition denies it (apache/arrow#49949). It lets the role list the key names (not read
    the contents) of the whole bucket: docs/security.md. A bucket the job only reads keeps the condition."""
    arn = f"arn:{_partition(region)}:s3:::"
    grants = role_grants(s3)
    buckets = list(dict.fromkeys(g.bucket for g in grants))
    statements: list[dict[str, Any]] = [
        {"Effect": "Allow", "Action": ["s3:GetBucketLocation"], "Resource": _one_or_many([arn + b for b in buckets])}
    ]
    for bucket in buckets:
        prefixes = [g.prefix for g in grants if g.bucket == bucket]
        listing: dict[str, Any] = {"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": arn + bucket}
        if all(prefixes) and bucket != grants[0].bucket:
            allowed = [p for prefix in dict.fromkeys(prefixes) for p in (prefix, f"{prefix}/*")]
            listing["Condition"] = {"StringLike": {"s3:prefix": allowed}}
        statements.append(listing)
    store = grants[0]
    statements.append({"Effect": "Allow", "Action": list(READ_WRITE),
                       "Resource": f"{arn}{store.bucket}/{store.prefix + '/' if store.prefix else ''}*"})
    # A read location may be one object (a code zip) or a folder: allow both the key itself and what is under it.
    readable = [f"{arn}{g.bucket}/{key}" for g in grants[1:]
                for key in ((g.prefix, f"{g.prefix}/*") if g.prefix else ("*",))]
    if readable:
        statements.append({"Effect": "Allow", "Action": ["s3:GetObject"], "Resource": _one_or_many(readable)})
    return {"Version": "2012-10-17", "Statement": statements}


def job_s3_uses(job: JobSpec) -> list[S3Use]:
    """The S3 URIs a job spec itself writes (run.storage) and reads (data.train, data.eval, model.path)."""
    candidates = [S3Use("run.storage", job.run.storage, write=True)]
    candidates += [S3Use(field, location) for field, location in job.data.locations()]
    if job.model.path is not None:
        candidates.append(S3Use("model.path", job.model.path))
    return [u for u in candidates if u.uri.startswith("s3://")]


def runtime_env_s3_uses(working_dir: str | None, py_modules: Iterable[str | None]) -> list[S3Use]:
    """The S3 URIs of a runtime_env: the working dir and py_modules zips Ray downloads on every node."""
    candidates = [S3Use("runtime_env.working_dir", working_dir or "", code=True)]
    candidates += [S3Use("runtime_env.py_modules", m or "", code=True) for m in py_modules]
    return [u for u in candidates if u.uri.startswith("s3://")]


def _location_problem(field: str, uri: str, write: bool, whole_bucket_ok: bool) -> Problem | None:
    bucket, key = split_s3(uri)
    example = f"s3://{bucket}/{'runs' if write else 'data'}"
    if "*" in key or "?" in key:
        return Problem(field, f"{uri} holds a wildcard; IAM reads * and ? in the policy as patterns, so the role "
                       "would reach more than this one folder", hint=f"name the folder itself, e.g. {example}")
    if ".." in key.split("/"):
        return Problem(field, f"{uri} has a '..' segment; S3 keys are literal, so the role's folder would not be "
                       "the one the path seems to name", hint=f"write the folder without '..', e.g. {example}")
    if not key and not whole_bucket_ok:
        reach = "read, write and delete" if write else "read"
        return Problem(field, f"{uri} is a whole bucket; the pods' role could {reach} every object in it",
                       hint=f"narrow it to a folder, e.g. {example}, or set storage.s3.allow_whole_bucket: true "
                       "if the bucket holds nothing else")
    return None


def location_problems(s3: S3Storage) -> list[Problem]:
    """The storage locations that would widen the rendered policy beyond the folders they name (a whole bucket is
    the user's business with their own role, `role_arn`: no policy is rendered then)."""
    whole_ok = s3.allow_whole_bucket or s3.role_arn is not None
    found = [_location_problem("storage.s3.uri", s3.uri, True, whole_ok)]
    found += [_location_problem(f"storage.s3.read[{i}]", uri, False, whole_ok) for i, uri in enumerate(s3.read)]
    return [p for p in found if p is not None]


def _code_problems(s3: S3Storage, uses: list[S3Use]) -> list[Problem]:
    """Code under the writable `uri`: any job (or anything holding the role) could replace what every node runs."""
    store = Grant(s3.bucket, s3.prefix, True)
    return [Problem(u.field, f"{u.uri} is under storage.s3.uri ({store.uri()}), which the pods' role may write: "
                    "a job could replace the code every node runs",
                    hint=f"upload code outside it, e.g. s3://{s3.bucket}/code/, and list that folder in "
                    "storage.s3.read of the cluster spec (read-only)")
            for u in uses if u.code and store.covers(*split_s3(u.uri))]


def _reach(grants: list[Grant]) -> str:
    reads = [g.uri() for g in grants if not g.write]
    return f"read-write {grants[0].uri()}" + (f", read-only {', '.join(reads)}" if reads else "")


def s3_access_problems(cluster: ClusterSpec, uses: Iterable[S3Use]) -> list[Problem]:
    """Every S3 URI in `uses` that the cluster's rendered role may not read (or write, where the use writes)."""
    uses = [u for u in uses if u.uri.startswith("s3://")]
    s3 = cluster.storage.s3 if cluster.storage else None
    code = _code_problems(s3, uses) if s3 is not None else []
    if not uses or (s3 is not None and s3.role_arn is not None):
        return code
    if s3 is None:
        return [Problem(u.field, f"{u.uri}: the cluster spec has no storage.s3, so its pods have no S3 role",
                        hint="add storage.s3 (uri: where runs are written; read: locations the job only reads)")
                for u in uses]
    grants, problems = role_grants(s3), code
    for u in uses:
        bucket, key = split_s3(u.uri)
        if any(g.covers(bucket, key) and (g.write or not u.write) for g in grants):
            continue
        verb = "write" if u.write else "read"
        if u.write:
            hint = f"keep {u.field} under {grants[0].uri()} (a local run.storage in the job spec takes the cluster's)"
        elif u.code:
            hint = "list its folder in storage.s3.read of the cluster spec (code stays out of storage.s3.uri)"
        else:
            hint = f"move it under {grants[0].uri()}, or list its location in storage.s3.read of the cluster spec"
        problems.append(Problem(u.field, f"{u.uri} is outside what the pods' S3 role may {verb} ({_reach(grants)})",
                                hint=hint))
    return problems


def check_s3_access(cluster: ClusterSpec, uses: Iterable[S3Use]) -> None:
    """SpecError, one line, when the cluster's S3 role does not cover every URI the job uses."""
    raise_problems(s3_access_problems(cluster, uses))
