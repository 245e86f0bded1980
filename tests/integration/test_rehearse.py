"""`trainlift rehearse` on the reference cluster's render: a real local Ray head and two raylets shaped like its
RayCluster, run from a virtualenv of the DLC's locked packages (its Ray 2.58, transformers 5.13, no trainlift, no
peft), the RayJob submitted through a real dashboard's Jobs API, code, trainlift and checkpoints on a real
S3-compatible server (moto, over HTTP). What only EKS can show (EFA, GPUs, the image's CUDA builds) is not tested
here."""

from __future__ import annotations

import json
import os
import runpy
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import boto3
import pytest
import yaml

h = runpy.run_path(str(Path(__file__).with_name("conftest_aws.py")))["load"]()  # the session's moto server
REPO = Path(__file__).resolve().parents[2]
BUCKET = "my-trainlift-checkpoints"  # the reference cluster spec's bucket
TRAINLIFT = os.path.join(os.path.dirname(sys.executable), "trainlift")


def cli(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_ADDRESS": "", "AWS_REGION": "us-east-2"}
    return subprocess.run([TRAINLIFT, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def zip_dir(source: Path, target: Path, inside: str = "") -> None:
    with zipfile.ZipFile(target, "w") as z:
        for path in sorted(source.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                z.write(path, f"{inside}{path.relative_to(source)}")


@pytest.fixture
def project(monkeypatch, tmp_path, tiny_assets, image_env):
    """A project (tiny model, data, job spec) zipped to S3 with trainlift's wheel, as docs/eks.md says."""
    h.use(monkeypatch, tmp_path)
    s3 = boto3.client("s3", region_name="us-east-2")
    s3.create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": "us-east-2"})
    root = tmp_path / "project"
    shutil.copytree(tiny_assets / "model", root / "model")
    shutil.copy(tiny_assets / "train.jsonl", root / "train.jsonl")
    (root / "job.yaml").write_text(yaml.safe_dump({
        "model": {"path": "model"}, "data": {"train": "train.jsonl", "seq_len": 64},
        "train": {"steps": 4, "micro_batch_size": 2, "warmup_steps": 1}, "checkpoint": {"every_steps": 2},
        "run": {"name": "rehearsed", "storage": "runs"}}))
    zip_dir(root, tmp_path / "job.zip")
    s3.upload_file(str(tmp_path / "job.zip"), BUCKET, "code/job.zip")
    packaged = cli("package", "-o", str(tmp_path / "dist"), "--upload", f"s3://{BUCKET}/code/", "--json", cwd=root)
    assert packaged.returncode == 0, packaged.stderr
    return root, s3, json.loads(packaged.stdout)["uri"]


def render(root: Path, out: Path, trainlift_uri: str, job: str = "job.yaml") -> None:
    rendered = cli("render", str(REPO / "examples" / "cluster-reference.yaml"), "--job", job, "--working-dir",
                   f"s3://{BUCKET}/code/job.zip", "--trainlift-uri", trainlift_uri, "-o", str(out), cwd=root)
    assert rendered.returncode == 0, rendered.stderr


def readme_rehearsal() -> list[str]:
    """The `trainlift rehearse` command of the reference rehearsal in docs/rehearse.md, as a user would paste it."""
    text = (REPO / "docs" / "rehearse.md").read_text()
    section = text[text.index("## The reference job, rehearsed"):]
    lines = section.replace("\\\n", " ").splitlines()
    return shlex.split(next(line for line in lines if line.startswith("trainlift rehearse ")))


def test_the_reference_job_rehearses_as_the_readme_shows(monkeypatch, tmp_path, image_env):
    """examples/qwen2.5-1.5b-eks.yaml on examples/cluster-reference.yaml (GPUs, bf16, 8 CPUs a worker), rehearsed
    with the docs' command in the image's environment: no `--set` beyond the model's size and the steps."""
    h.use(monkeypatch, tmp_path)
    s3 = boto3.client("s3", region_name="us-east-2")
    s3.create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": "us-east-2"})
    examples = REPO / "examples"
    with zipfile.ZipFile(tmp_path / "job.zip", "w") as z:
        for path in [examples / "qwen2.5-1.5b-eks.yaml", *sorted((examples / "data").iterdir()),
                     *sorted((examples / "tiny").rglob("*")), *sorted((examples / "model-configs").iterdir())]:
            if path.is_file():
                z.write(path, path.relative_to(examples).as_posix())
    s3.upload_file(str(tmp_path / "job.zip"), BUCKET, "code/job.zip")
    packaged = cli("package", "-o", str(tmp_path / "dist"), "--upload", f"s3://{BUCKET}/code/", "--json", cwd=examples)
    assert packaged.returncode == 0, packaged.stderr
    rendered = cli("render", "cluster-reference.yaml", "--job", "qwen2.5-1.5b-eks.yaml", "--working-dir",
                   f"s3://{BUCKET}/code/job.zip", "--trainlift-uri", json.loads(packaged.stdout)["uri"], "-o",
                   str(tmp_path / "out"), cwd=examples)
    assert rendered.returncode == 0, rendered.stderr

    command = readme_rehearsal()
    assert command[:3] == ["trainlift", "rehearse", "../out/"]
    result = cli("rehearse", str(tmp_path / "out"), *command[3:], "--json", cwd=examples)
    assert result.stdout, result.stderr[-3000:]
    outcome = json.loads(result.stdout)
    assert result.returncode == 0 and outcome["ok"] and outcome["status"] == "SUCCEEDED", "\n".join(
        f"{c['state']}: {c['evidence']}" for c in outcome["checks"])
    assert len(outcome["checks"]) == 5 and "EFA and the NCCL transport" in outcome["not_proven"]
    [queue] = [c for c in outcome["checks"] if c["check"].startswith("Kueue admits")]  # render's check, on paper
    assert queue["state"] == "ok" and "RayCluster ray-train admitted in ClusterQueue ray-train" in queue["evidence"]
    assert {"scaling.workers=2", "scaling.device=cpu", "scaling.cpus_per_worker=1"} <= set(outcome["rehearsed_as"])
    where = outcome["environment"]
    assert where["image"] and where["image_python"] == "3.13.12" and "deepspeed" in where["left_out"]
    # The rehearsal's run is its own: the job's run.name, which the real job will use, holds nothing.
    run = "ray-train/qwen2.5-1.5b-tasks-rehearsal"
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{run}/")["Contents"]}
    assert f"{run}/summary.json" in keys and any("/checkpoint_00000004/" in k for k in keys)
    assert f"{run}/final/config.json" in keys
    assert s3.list_objects_v2(Bucket=BUCKET, Prefix="ray-train/qwen2.5-1.5b-tasks/").get("KeyCount") == 0
    assert outcome["run"]["uri"] == f"s3://{BUCKET}/{run}" and outcome["run"]["steps"] == 4
    assert outcome["run"]["line"].startswith(f"rehearsal run: s3://{BUCKET}/{run}: 4 steps, loss ")
    # Every S3 request of the job and its Ray, recorded at the server, is one the rendered role allows.
    [role] = [c for c in outcome["checks"] if c["check"].startswith("the pods' S3 role allows all")]
    requests = outcome["s3_requests"]
    assert role["state"] == "ok" and requests["recorded"] and requests["denied"] == [] and requests["unknown"] == []
    assert requests["operations"]["HeadBucket"] >= 1 and requests["operations"]["CompleteMultipartUpload"] >= 1


def test_a_trainlift_zip_of_the_old_layout_fails_and_says_why(project, tmp_path):
    """`cd src && zip -r trainlift.zip trainlift` (the layout README once gave): Ray unpacks the folder's contents,
    so the image cannot import trainlift; nor can the image's environment here."""
    root, s3, _ = project
    zip_dir(REPO / "src" / "trainlift", tmp_path / "trainlift.zip", inside="trainlift/")
    s3.upload_file(str(tmp_path / "trainlift.zip"), BUCKET, "code/trainlift.zip")
    render(root, tmp_path / "out", f"s3://{BUCKET}/code/trainlift.zip")
    result = cli("rehearse", str(tmp_path / "out"), "--json", cwd=root)
    assert result.stdout, result.stderr[-3000:]
    outcome = json.loads(result.stdout)
    assert result.returncode == 1 and outcome["status"] == "FAILED"
    failed = [c for c in outcome["checks"] if c["state"] == "failed"]
    assert "cannot import trainlift" in failed[0]["evidence"] and "trainlift package" in failed[0]["evidence"]


def test_a_package_the_job_imports_that_the_image_lacks_fails_the_rehearsal_in_one_line(project, tmp_path):
    """A LoRA job whose RayJob does not bring peft (its runtime_env `pip` removed, as a render before the fix
    wrote it): the image has no peft, nor has its environment here, so the job stops where it would on EKS."""
    root, s3, wheel_uri = project
    spec = yaml.safe_load((root / "job.yaml").read_text())
    spec["model"]["lora"] = {"r": 4}
    (root / "lora.yaml").write_text(yaml.safe_dump(spec))
    zip_dir(root, tmp_path / "job.zip")
    s3.upload_file(str(tmp_path / "job.zip"), BUCKET, "code/job.zip")
    render(root, tmp_path / "out", wheel_uri, job="lora.yaml")
    rayjob = tmp_path / "out" / "k8s" / "30-rayjob.yaml"
    body = yaml.safe_load(rayjob.read_text())
    env = yaml.safe_load(body["spec"]["runtimeEnvYAML"])
    pip = env.pop("pip")  # what render adds for model.lora: peft, hash-checked
    assert [line.split()[0] for line in pip["packages"]] == ["peft==0.21.2"] and "--require-hashes" in pip[
        "pip_install_options"]
    body["spec"]["runtimeEnvYAML"] = yaml.safe_dump(env)
    rayjob.write_text(yaml.safe_dump(body))
    result = cli("rehearse", str(tmp_path / "out"), "--json", cwd=root)
    outcome = json.loads(result.stdout)
    assert result.returncode == 1 and outcome["status"] == "FAILED"
    failed = [c for c in outcome["checks"] if c["state"] == "failed"]
    assert "model.lora needs the peft package" in failed[-1]["evidence"]
    assert "\n" not in failed[-1]["evidence"]


def test_a_render_whose_uris_the_role_does_not_cover_fails_before_anything_starts(project, tmp_path):
    root, _, wheel_uri = project
    render(root, tmp_path / "out", wheel_uri)
    rayjob = tmp_path / "out" / "k8s" / "30-rayjob.yaml"
    body = yaml.safe_load(rayjob.read_text())
    env = yaml.safe_load(body["spec"]["runtimeEnvYAML"])
    env["working_dir"] = "s3://someone-elses-bucket/code/job.zip"  # a hand edit, or a render from before the check
    body["spec"]["runtimeEnvYAML"] = yaml.safe_dump(env)
    rayjob.write_text(yaml.safe_dump(body))
    result = cli("rehearse", str(tmp_path / "out"), cwd=root, timeout=60)
    assert result.returncode == 2
    assert "runtime_env.working_dir: the pods' S3 role does not allow s3:GetObject on " \
           "s3://someone-elses-bucket/code/job.zip" in result.stderr


def _edit_role(out: Path, edit) -> None:
    eksctl = yaml.safe_load((out / "eksctl.yaml").read_text())
    edit(eksctl["iam"]["serviceAccounts"][0]["attachPolicy"]["Statement"])
    (out / "eksctl.yaml").write_text(yaml.safe_dump(eksctl))


def test_a_role_that_lists_only_under_prefixes_fails_before_anything_starts(project, tmp_path):
    """The role render wrote before (apache/arrow#49949): s3:ListBucket only with an s3:prefix condition. On EKS the
    job's first write fails with ACCESS_DENIED during HeadBucket; here, in one line, before any process starts."""
    root, _, wheel_uri = project
    render(root, tmp_path / "out", wheel_uri)
    _edit_role(tmp_path / "out", lambda statements: statements[1].update(
        Condition={"StringLike": {"s3:prefix": ["ray-train", "ray-train/*", "code", "code/*"]}}))
    result = cli("rehearse", str(tmp_path / "out"), cwd=root, timeout=60)
    assert result.returncode == 2
    assert ("run.storage: the pods' S3 role does not allow s3:ListBucket with no s3:prefix (HeadBucket, which "
            "pyarrow sends before it writes) on s3://my-trainlift-checkpoints/ray-train") in result.stderr
    assert "starting a Ray head" not in result.stderr


def test_a_request_the_role_denies_fails_the_rehearsal_naming_the_call_the_key_and_the_statement(project, tmp_path):
    """A Deny on the checkpoints, which no check on paper foresees: the job runs (the server does not enforce the
    role), and the recorded requests fail the rehearsal in one line."""
    root, _, wheel_uri = project
    render(root, tmp_path / "out", wheel_uri)
    _edit_role(tmp_path / "out", lambda statements: statements.append(
        {"Sid": "NoCheckpoints", "Effect": "Deny", "Action": "s3:PutObject",
         "Resource": f"arn:aws:s3:::{BUCKET}/ray-train/*/checkpoint_*"}))  # the rehearsal's own run too
    result = cli("rehearse", str(tmp_path / "out"), "--json", cwd=root)
    outcome = json.loads(result.stdout)
    assert result.returncode == 1 and outcome["status"] == "SUCCEEDED"
    [role] = [c for c in outcome["checks"] if c["state"] == "failed"]
    assert role["check"].startswith("the pods' S3 role allows all") and "\n" not in role["evidence"]
    assert f"needs s3:PutObject on arn:aws:s3:::{BUCKET}/ray-train/rehearsed-rehearsal/checkpoint_0000000" in role[
        "evidence"]
    assert "explicitly denied by the role's statement 5 (NoCheckpoints)" in role["evidence"]
    assert role["evidence"].split(" ")[1].startswith(f"s3://{BUCKET}/ray-train/rehearsed-rehearsal/checkpoint_0000000")
