"""What `trainlift rehearse` reads from a render (the reference deployment's golden files) and judges before it
starts anything. Pure."""

import json
from dataclasses import replace
from pathlib import Path

from trainlift.config.job import load_job_spec
from trainlift.ops.rehearse import (
    ON_CPU_SLOTS, Outcome, job_entrypoint, judge, rehearsal_of, rehearsed_as, role_problems,
    trainlift_origin_problem,
)

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "reference"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_rendered_pods_become_a_head_and_one_raylet_per_worker_pod_with_gpus_as_cpu_slots():
    plan = rehearsal_of(GOLDEN)
    assert plan.head.ray_start == {"num-cpus": "0"} and plan.head.env["RAY_JOB_STOP_WAIT_TIME_S"]
    [workers] = plan.workers
    assert (workers.replicas, workers.ray_start) == (2, {"num-cpus": "4"})
    assert "FI_PROVIDER" not in workers.env and workers.from_secrets == ("HF_TOKEN",)
    assert [uri for _, uri, _ in plan.s3_uses] == ["s3://my-trainlift-checkpoints/code/trainlift-job.zip",
                                                   "s3://my-trainlift-checkpoints/code/trainlift.zip",
                                                   "s3://my-trainlift-checkpoints/ray-train"]


def test_the_role_check_reads_the_rendered_policy():
    plan = rehearsal_of(GOLDEN)
    assert role_problems(plan) == []
    moved = replace(plan, s3_uses=(("run.storage", "s3://my-trainlift-checkpoints/code/runs", True),
                                   ("runtime_env.working_dir", "s3://other-bucket/job.zip", False)))
    assert role_problems(moved) == [
        "run.storage: the pods' S3 role does not allow s3:PutObject on s3://my-trainlift-checkpoints/code/runs",
        "runtime_env.working_dir: the pods' S3 role does not allow s3:GetObject on s3://other-bucket/job.zip"]
    assert role_problems(replace(moved, s3_policy=None)) == []  # an existing role_arn: its policy is not rendered


def test_the_entrypoint_is_the_rayjobs_with_the_probe_first_then_the_cpu_slots_then_the_users_overrides():
    plan = rehearsal_of(GOLDEN)
    entry = job_entrypoint(plan, ["model.path=s3://b/tiny", "scaling.cpus_per_worker=2"], workers=2)
    probe, rest = entry.split(" && ", 1)
    assert probe.startswith("python -c") and rest.startswith(plan.entrypoint)
    assert rest.endswith("--set scaling.workers=2 --set scaling.device=cpu --set scaling.cpus_per_worker=1 "
                         "--set scaling.expect_fabric=any --set model.attn_implementation=auto "
                         "--set run.name=qwen2-5-1-5b-sft-rehearsal "  # a run of its own, never the job's
                         "--set model.path=s3://b/tiny --set scaling.cpus_per_worker=2")  # the user's, last, win


def test_a_gpu_job_is_rehearsed_as_a_cpu_job_and_says_so():
    plan = rehearsal_of(GOLDEN)  # 4 GPUs per worker pod, each a CPU slot
    assert plan.rehearsed_as == ON_CPU_SLOTS
    assert rehearsed_as(plan, 2) == ("scaling.workers=2", "scaling.device=cpu", "scaling.cpus_per_worker=1",
                                     "scaling.expect_fabric=any", "model.attn_implementation=auto",
                                     "run.name=qwen2-5-1-5b-sft-rehearsal")
    # What the overrides set must be what the job spec accepts.
    spec = load_job_spec(EXAMPLES / "qwen2.5-1.5b-eks.yaml", list(rehearsed_as(plan, 2)))
    assert (spec.scaling.device, spec.scaling.cpus_per_worker, spec.scaling.workers) == ("cpu", 1, 2)
    assert spec.model.attn_implementation == "auto" and spec.scaling.expect_fabric == "any"
    outcome = Outcome("SUCCEEDED", "", "", [], rehearsed_as(plan, 2))
    assert outcome.to_dict()["rehearsed_as"][:2] == ["scaling.workers=2", "scaling.device=cpu"]
    assert job_entrypoint(replace(plan, rehearsed_as=(), run=None), [], 2).endswith("--set scaling.workers=2")


def test_a_failure_is_evidenced_by_a_short_tail_never_a_whole_traceback():
    traceback = "Traceback (most recent call last):\n" + "".join(
        f'  File "/x/y{i}.py", line {i}, in f\n    call_{i}(' + "a" * 120 + ")\n" for i in range(70))
    message = ("Failed to set up runtime environment.\n" + traceback
               + "botocore.exceptions.NoCredentialsError: Unable to locate credentials\n")
    checks = judge(rehearsal_of(GOLDEN), "FAILED", "", message)
    evidence = [e for _, state, e in checks if state == "failed"]
    assert evidence and all(len(e) <= 400 and "\n" not in e for e in evidence)
    assert evidence[0].endswith("NoCredentialsError: Unable to locate credentials")


def test_trainlift_from_anywhere_but_py_modules_is_named():
    installed = "trainlift-imported-from /home/me/.venv/lib/python3.11/site-packages/trainlift/__init__.py"
    shipped = "trainlift-imported-from /tmp/ray/session_1/runtime_resources/py_modules_files/t/trainlift/__init__.py"
    assert "not from py_modules" in trainlift_origin_problem(installed)
    assert trainlift_origin_problem(shipped) is None
    assert trainlift_origin_problem("python -c \"...print('trainlift-imported-from ' + ...)\"") is not None


def test_a_render_in_another_partition_is_checked_the_same_way():
    plan = rehearsal_of(GOLDEN)
    policy = json.loads(json.dumps(plan.s3_policy).replace('"arn:aws:', '"arn:aws-cn:'))
    assert role_problems(replace(plan, s3_policy=policy)) == []


def test_the_render_queue_is_admitted_on_paper_and_an_edit_that_breaks_it_fails_the_check(tmp_path):
    import shutil

    plan = rehearsal_of(GOLDEN)
    [check] = [c for c in judge(plan, "SUCCEEDED", "", "") if c[0].startswith("Kueue admits")]
    assert check[1] == "ok" and "RayCluster ray-train admitted in ClusterQueue ray-train" in check[2]
    assert "RayJob qwen2-5-1-5b-sft runs on RayCluster ray-train (clusterSelector)" in check[2]
    edited = tmp_path / "out"
    shutil.copytree(GOLDEN, edited)
    [queue_file] = (edited / "k8s").glob("15-*clusterqueue*.yaml")
    queue_file.write_text(queue_file.read_text().replace("nominalQuota: '8'", "nominalQuota: '4'"))
    [check] = [c for c in judge(rehearsal_of(edited), "SUCCEEDED", "", "") if c[0].startswith("Kueue admits")]
    assert check[1] == "failed" and "it needs nvidia.com/gpu 8 in flavor ray-train-gpu-workers, whose quota" in check[2]


def test_a_role_that_lists_only_under_prefixes_is_refused_before_anything_starts(tmp_path):
    """The role trainlift rendered before (apache/arrow#49949): s3:ListBucket only with an s3:prefix condition.
    Every write starts with pyarrow's HeadBucket, which S3 authorises as s3:ListBucket with no s3:prefix."""
    import shutil

    import pytest
    import yaml

    from trainlift.errors import UsageError
    from trainlift.ops.rehearse import preflight

    edited = tmp_path / "out"
    shutil.copytree(GOLDEN, edited)
    eksctl = yaml.safe_load((edited / "eksctl.yaml").read_text())
    listing = eksctl["iam"]["serviceAccounts"][0]["attachPolicy"]["Statement"][1]
    assert listing["Action"] == ["s3:ListBucket"] and "Condition" not in listing
    listing["Condition"] = {"StringLike": {"s3:prefix": ["ray-train", "ray-train/*", "code", "code/*"]}}
    (edited / "eksctl.yaml").write_text(yaml.safe_dump(eksctl))
    plan = rehearsal_of(edited)
    assert role_problems(plan) == [
        "run.storage: the pods' S3 role does not allow s3:ListBucket with no s3:prefix (HeadBucket, which pyarrow "
        "sends before it writes) on s3://my-trainlift-checkpoints/ray-train"]
    with pytest.raises(UsageError) as info:
        preflight(plan)  # before any S3 call or process
    assert "render again" in info.value.hint
