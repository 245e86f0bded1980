"""What `trainlift rehearse` reads from a render (the reference deployment's golden files) and judges before it
starts anything. Pure."""

from dataclasses import replace
from pathlib import Path

from trainlift.ops.rehearse import job_entrypoint, rehearsal_of, role_problems, trainlift_origin_problem

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "reference"


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
    assert role_problems(replace(moved, s3_grants=())) == []  # an existing role_arn: its policy is not rendered


def test_the_entrypoint_is_the_rayjobs_with_the_probe_first_and_the_overrides_last():
    plan = rehearsal_of(GOLDEN)
    entry = job_entrypoint(plan, ["model.path=s3://b/tiny"], workers=2)
    probe, rest = entry.split(" && ", 1)
    assert probe.startswith("python -c") and rest.startswith(plan.entrypoint)
    assert rest.endswith("--set scaling.workers=2 --set model.path=s3://b/tiny")


def test_trainlift_from_anywhere_but_py_modules_is_named():
    installed = "trainlift-imported-from /home/me/.venv/lib/python3.11/site-packages/trainlift/__init__.py"
    shipped = "trainlift-imported-from /tmp/ray/session_1/runtime_resources/py_modules_files/t/trainlift/__init__.py"
    assert "not from py_modules" in trainlift_origin_problem(installed)
    assert trainlift_origin_problem(shipped) is None
    assert trainlift_origin_problem("python -c \"...print('trainlift-imported-from ' + ...)\"") is not None


def test_a_render_in_another_partition_is_checked_the_same_way():
    plan = rehearsal_of(GOLDEN)
    china = replace(plan, s3_grants=tuple((a, r.replace("arn:aws:", "arn:aws-cn:")) for a, r in plan.s3_grants))
    assert role_problems(china) == []
