"""The pods' S3 role against what the job uses: render refuses a URI the rendered IAM policy does not cover.

Pure: the policy is the one eksctl would attach (iam.serviceAccounts[].attachPolicy); coverage is
checked against it without AWS. The last tests judge requests against the rendered policy with IAM's rules
(render/iam_eval.py), so the check and the policy cannot drift.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from trainlift.config.cluster import parse_cluster_spec
from trainlift.config.job import validate_job_spec
from trainlift.errors import SpecError
from trainlift.render import JobInputs, render_cluster
from trainlift.render.iam_eval import evaluate, make_request
from trainlift.render.s3_access import S3Use, check_s3_access, job_s3_uses, s3_access_problems

BASE: dict[str, Any] = {
    "name": "train",
    "availability_zones": ["us-east-2a", "us-east-2b"],
    "workers": [{"instance_type": "g6.12xlarge", "count": 2, "availability_zones": ["us-east-2a"]}],
    "storage": {"s3": {"uri": "s3://ckpt-bucket/ray-train", "read": ["s3://ckpt-bucket/code"]}},
}


def cluster(**storage: Any):
    data = copy.deepcopy(BASE)
    if storage:
        data["storage"] = storage
    return parse_cluster_spec(data)


def job(working_dir: str, trainlift_uri: str = "s3://ckpt-bucket/code/trainlift.zip") -> JobInputs:
    return JobInputs(name="sft", spec_path="job.yaml", workers=8, working_dir=working_dir, trainlift_uri=trainlift_uri)


def test_uris_the_role_covers_render():
    manifests = render_cluster(cluster(), job("s3://ckpt-bucket/code/job.zip"),
                               s3_uses=[S3Use("run.storage", "s3://ckpt-bucket/ray-train", write=True)])
    assert any(m.kind == "RayJob" for m in manifests)


def test_a_working_dir_outside_the_prefix_is_refused_in_one_line():
    with pytest.raises(SpecError) as info:
        render_cluster(cluster(), job("s3://ckpt-bucket/elsewhere/job.zip"))
    line = info.value.one_line()
    assert "\n" not in line
    assert line.startswith("runtime_env.working_dir: s3://ckpt-bucket/elsewhere/job.zip is outside")
    assert "s3://ckpt-bucket/ray-train/" in line and "storage.s3.read" in line


def test_py_modules_in_another_bucket_is_refused():
    with pytest.raises(SpecError, match=r"^runtime_env\.py_modules: s3://other/trainlift\.zip"):
        render_cluster(cluster(), job("s3://ckpt-bucket/code/job.zip", "s3://other/trainlift.zip"))


def test_a_run_storage_elsewhere_is_refused_by_render():
    uses = [S3Use("run.storage", "s3://my-training-bucket/trainlift", write=True)]
    with pytest.raises(SpecError, match=r"^run\.storage: s3://my-training-bucket/trainlift is outside what the "
                                        r"pods' S3 role may write"):
        render_cluster(cluster(), job("s3://ckpt-bucket/code/job.zip"), s3_uses=uses)


def test_a_sibling_prefix_is_not_under_the_prefix():
    problems = s3_access_problems(cluster(), [S3Use("data.train", "s3://ckpt-bucket/ray-train-old/x.jsonl")])
    assert [p.path for p in problems] == ["data.train"]


def test_read_locations_cover_reads_but_not_writes():
    spec = cluster(s3={"uri": "s3://ckpt-bucket/ray-train", "read": ["s3://datasets/tasks", "s3://ckpt-bucket/code"]})
    reads = [S3Use("data.train", "s3://datasets/tasks/train.jsonl"), S3Use("data.eval", "s3://datasets/tasks"),
             S3Use("runtime_env.working_dir", "s3://ckpt-bucket/code/job.zip")]
    assert s3_access_problems(spec, reads) == []
    problems = s3_access_problems(spec, [S3Use("run.storage", "s3://datasets/tasks/runs", write=True)])
    assert len(problems) == 1 and "may write" in problems[0].message


def test_job_spec_uses_name_their_fields_and_skip_local_paths():
    spec = validate_job_spec({
        "model": {"path": "Qwen/Qwen2.5-1.5B"},
        "data": {"train": "s3://datasets/tasks/train.jsonl", "eval": "examples/data/tasks-eval.jsonl"},
        "run": {"storage": "s3://ckpt-bucket/ray-train"},
    })
    assert job_s3_uses(spec) == [
        S3Use("run.storage", "s3://ckpt-bucket/ray-train", write=True),
        S3Use("data.train", "s3://datasets/tasks/train.jsonl"),
    ]
    on_s3 = spec.model_copy(update={"model": spec.model.model_copy(update={"path": "s3://models/qwen2.5-1.5b"})})
    assert S3Use("model.path", "s3://models/qwen2.5-1.5b") in job_s3_uses(on_s3)  # each node reads it


def test_submit_side_check_is_one_line_with_a_hint():
    with pytest.raises(SpecError) as info:
        check_s3_access(cluster(), [S3Use("data.train", "s3://datasets/x.jsonl"),
                                    S3Use("run.storage", "s3://other/runs", write=True)])
    assert info.value.message.count(";") == 1 and info.value.hint


def test_without_an_s3_role_every_s3_uri_is_refused():
    spec = cluster(fsx={"claim": "fsx-claim"})
    with pytest.raises(SpecError, match=r"^runtime_env\.working_dir: .*no storage\.s3"):
        render_cluster(spec, job("s3://ckpt-bucket/ray-train/code/job.zip"))


def test_an_existing_role_is_the_users_to_scope():
    spec = cluster(s3={"uri": "s3://ckpt-bucket/ray-train", "role_arn": "arn:aws:iam::123456789012:role/train"})
    assert s3_access_problems(spec, [S3Use("run.storage", "s3://elsewhere/runs", write=True)]) == []


def _allowed(policy: dict[str, Any], action: str, arn: str) -> bool:
    return evaluate(policy, make_request(action, arn)).allowed


@pytest.mark.parametrize("use", [
    S3Use("run.storage", "s3://ckpt-bucket/ray-train", write=True),
    S3Use("run.storage", "s3://ckpt-bucket/ray-train/team-a", write=True),
    S3Use("runtime_env.working_dir", "s3://ckpt-bucket/code/job.zip"),
    S3Use("data.train", "s3://datasets/tasks/train.jsonl"),
    S3Use("data.train", "s3://ckpt-bucket/ray-train-old/x.jsonl"),
    S3Use("data.train", "s3://datasets/other/x.jsonl"),
    S3Use("run.storage", "s3://datasets/tasks", write=True),
    S3Use("runtime_env.py_modules", "s3://elsewhere/trainlift.zip"),
])
def test_the_check_agrees_with_the_rendered_policy(use):
    spec = cluster(s3={"uri": "s3://ckpt-bucket/ray-train", "read": ["s3://datasets/tasks", "s3://ckpt-bucket/code"]})
    eksctl = next(m.body for m in render_cluster(spec) if m.path == "eksctl.yaml")
    policy = eksctl["iam"]["serviceAccounts"][0]["attachPolicy"]
    bucket, _, key = use.uri[len("s3://"):].partition("/")
    # An object the job would touch: the zip itself, or one below a directory.
    obj = f"arn:aws:s3:::{bucket}/{key}" if key.endswith((".zip", ".jsonl")) else f"arn:aws:s3:::{bucket}/{key}/r/x"
    allowed = _allowed(policy, "s3:GetObject", obj) and (not use.write or _allowed(policy, "s3:PutObject", obj))
    assert allowed == (s3_access_problems(spec, [use]) == [])
    if use.write and allowed:  # every write starts with HeadBucket: s3:ListBucket on the bucket, no s3:prefix
        assert _allowed(policy, "s3:ListBucket", f"arn:aws:s3:::{bucket}")


def test_the_listing_is_bucket_wide_only_where_the_job_writes():
    """HeadBucket needs an unconditioned s3:ListBucket on the storage bucket (apache/arrow#49949); a bucket the
    job only reads keeps its listing to the prefixes it reads."""
    spec = cluster(s3={"uri": "s3://ckpt-bucket/ray-train", "read": ["s3://datasets/tasks", "s3://ckpt-bucket/code"]})
    eksctl = next(m.body for m in render_cluster(spec) if m.path == "eksctl.yaml")
    policy = eksctl["iam"]["serviceAccounts"][0]["attachPolicy"]
    assert _allowed(policy, "s3:ListBucket", "arn:aws:s3:::ckpt-bucket")
    assert not _allowed(policy, "s3:ListBucket", "arn:aws:s3:::datasets")
    listing = lambda bucket, prefix: evaluate(policy, make_request("s3:ListBucket", f"arn:aws:s3:::{bucket}",
                                                                   {"s3:prefix": prefix})).allowed
    assert listing("datasets", "tasks/") and not listing("datasets", "other/")
    assert not _allowed(policy, "s3:PutObject", "arn:aws:s3:::ckpt-bucket/code/x")  # the listing grants no write
