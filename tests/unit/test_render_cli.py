"""`trainlift profiles` and `trainlift render` from the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainlift.cli import app
from trainlift.errors import SpecError

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "examples" / "cluster-reference.yaml"
REFERENCE_WORKER_GROUPS = __import__("yaml").safe_load(REFERENCE.read_text())["workers"]
TRAINLIFT = Path(sys.executable).parent / "trainlift"
runner = CliRunner()


def test_profiles_json_lists_the_catalog():
    result = runner.invoke(app, ["profiles", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["instance_type"]: row for row in json.loads(result.stdout)}
    p5 = rows["p5.48xlarge"]
    assert (p5["gpus"], p5["efa_interfaces"], p5["gpu_model"], p5["efa_supported"]) == (8, 32, "H100", True)
    assert p5["peak_bf16_flops_per_gpu"] == 989e12
    assert "DescribeInstanceTypes" in p5["sources"]["vcpus"]
    assert rows["m7i.xlarge"]["gpus"] == 0


def test_profiles_table():
    result = runner.invoke(app, ["profiles"])
    assert result.exit_code == 0
    assert "p6-b200.48xlarge" in result.stdout and "g6.12xlarge" in result.stdout


def test_render_writes_and_lists_the_manifests(tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["render", str(REFERENCE), "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["valid"] is True and summary["fabric"] == "efa"
    written = [Path(p) for p in summary["written"]]
    assert all(p.is_file() for p in written)
    assert {p.relative_to(out).as_posix() for p in written} >= {
        "eksctl.yaml", "helm/releases.yaml", "k8s/00-namespace.yaml", "k8s/20-raycluster.yaml"}
    golden = ROOT / "tests" / "golden" / "reference" / "k8s" / "20-raycluster.yaml"
    assert (out / "k8s" / "20-raycluster.yaml").read_text() == golden.read_text()


def test_render_human_output(tmp_path):
    result = runner.invoke(app, ["render", str(REFERENCE), "-o", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert "eksctl.yaml" in result.stdout and "fabric efa, 8 GPUs" in result.stdout


def test_render_check_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["render", str(REFERENCE), "--check", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["valid"] is True and "written" not in summary
    assert [p["path"] for p in summary["manifests"]][0] == "eksctl.yaml"
    assert list(tmp_path.iterdir()) == []


def test_render_needs_out_or_check():
    result = runner.invoke(app, ["render", str(REFERENCE)])
    assert result.exit_code != 0


def test_a_validation_error_writes_nothing(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text(REFERENCE.read_text().replace(
        "    availability_zones: [us-east-2a]", "    availability_zones: [us-east-2a, us-east-2b]"))
    out = tmp_path / "out"
    result = runner.invoke(app, ["render", str(spec), "-o", str(out)])
    assert isinstance(result.exception, SpecError)
    assert "workers[0].availability_zones" in result.exception.message
    assert not out.exists()


def test_a_schema_error_writes_nothing(tmp_path, monkeypatch):
    import trainlift.render as render

    original = render.render_raycluster

    def broken(spec, *args):
        body = original(spec, *args)
        body["spec"]["headGroupSpec"]["template"]["spec"]["shmSize"] = "1Gi"
        return body

    monkeypatch.setattr(render, "render_raycluster", broken)
    out = tmp_path / "out"
    result = runner.invoke(app, ["render", str(REFERENCE), "-o", str(out)])
    assert isinstance(result.exception, SpecError)
    assert "headGroupSpec.template.spec.shmSize: unknown field" in result.exception.message
    assert not out.exists()


def test_bad_spec_gives_one_line_and_exit_code_2(tmp_path):
    spec = tmp_path / "cluster.yaml"
    spec.write_text("name: demo\nworkers:\n  - instance_type: g6.12xlarge\n    gpus: 9\n    count: 2\n"
                    "    availability_zones: [us-east-2a]\navailability_zones: [us-east-2a, us-east-2b]\n")
    result = subprocess.run([str(TRAINLIFT), "render", str(spec), "--check"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: workers[0].gpus: 9 GPUs per worker but g6.12xlarge has 4")


def test_render_with_a_job_adds_a_rayjob(tmp_path, monkeypatch):
    pytest.importorskip("trainlift.config.job")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.yaml").write_text(
        "model: {path: Qwen/Qwen2.5-1.5B}\ndata: {train: data/train.jsonl}\n"
        "scaling: {workers: 8}\nrun: {name: sft-demo}\n"
    )
    result = runner.invoke(app, ["render", str(REFERENCE), "--job", "job.yaml", "-o", "out",
                                 "--working-dir", "s3://my-trainlift-checkpoints/code/job.zip",
                                 "--trainlift-uri", "s3://my-trainlift-checkpoints/code/trainlift.zip"])
    assert result.exit_code == 0, result.output
    job = (tmp_path / "out" / "k8s" / "30-rayjob.yaml").read_text()
    assert "entrypoint: python -m trainlift train job.yaml --set run.storage=s3://my-trainlift-checkpoints/ray-train" in job
    assert "name: sft-demo" in job


def test_render_refuses_a_job_whose_mlflow_secret_the_pods_do_not_read_and_passes_once_listed(tmp_path, monkeypatch):
    """run.mlflow_secret names the Secret; the pods' environment comes only from the cluster spec's secrets."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.yaml").write_text(
        "model: {path: Qwen/Qwen2.5-1.5B}\ndata: {train: data/train.jsonl}\nscaling: {workers: 8}\n"
        "run: {name: sft-demo, trackers: [mlflow], mlflow_uri: 'https://mlflow.example', mlflow_secret: mlflow-auth}\n")
    args = ["render", "cluster.yaml", "--job", "job.yaml", "--check", "--working-dir",
            "s3://my-trainlift-checkpoints/code/job.zip", "--trainlift-uri", "s3://my-trainlift-checkpoints/code/t.whl"]
    (tmp_path / "cluster.yaml").write_text(REFERENCE.read_text())
    refused = subprocess.run([str(TRAINLIFT), *args], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert refused.returncode == 2
    line = refused.stderr.strip()
    assert line.startswith("error: run.mlflow_secret: the cluster's pods do not read MLflow credentials from Secret "
                           "mlflow-auth") and "\n" not in line
    assert "{env: MLFLOW_TRACKING_TOKEN, secret: mlflow-auth, key: MLFLOW_TRACKING_TOKEN}" in line
    (tmp_path / "cluster.yaml").write_text(REFERENCE.read_text() + "  - {env: MLFLOW_TRACKING_TOKEN, "
                                           "secret: mlflow-auth, key: token}\n")  # the file ends in secrets:
    listed = runner.invoke(app, args)
    assert listed.exit_code == 0, listed.output
    rendered = runner.invoke(app, args[:4] + ["-o", "out"] + args[5:])
    assert rendered.exit_code == 0, rendered.output
    raycluster = (tmp_path / "out" / "k8s" / "20-raycluster.yaml").read_text()
    assert raycluster.count("name: mlflow-auth") == 1 + len(REFERENCE_WORKER_GROUPS)  # the head and each group


ECR_IMAGE = "123456789012.dkr.ecr.us-east-2.amazonaws.com/team/ray"
PINNED_DLC = "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.1.0"


@pytest.fixture()
def ecr(monkeypatch):
    """moto's ECR with one image pushed as `team/ray:v1`; yields its digest."""
    boto3 = pytest.importorskip("boto3")
    moto = pytest.importorskip("moto")
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing")):
        monkeypatch.setenv(name, value)
    with moto.mock_aws():
        client = boto3.client("ecr", region_name="us-east-2")
        client.create_repository(repositoryName="team/ray")
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "size": 7,
                       "digest": "sha256:" + "c" * 64},
            "layers": [],
        })
        yield client.put_image(repositoryName="team/ray", imageManifest=manifest, imageTag="v1")["image"]["imageId"][
            "imageDigest"]


def test_image_digest_of_an_ecr_tag(ecr):
    """ecr:DescribeImages against moto's ECR."""
    from trainlift.cloud.capacity import Unknown
    from trainlift.cloud.ecr import image_digest

    assert image_digest(f"{ECR_IMAGE}:v1") == ecr
    missing = image_digest(f"{ECR_IMAGE}:v2")
    assert isinstance(missing, Unknown) and "ImageNotFoundException" in missing.reason


def test_image_digest_needs_a_private_ecr_registry():
    from trainlift.cloud.capacity import Unknown
    from trainlift.cloud.ecr import image_digest

    found = image_digest(PINNED_DLC)
    assert isinstance(found, Unknown) and "public.ecr.aws" in found.reason


def test_render_pins_an_ecr_image_by_digest(tmp_path, ecr):
    spec = tmp_path / "cluster.yaml"
    spec.write_text(REFERENCE.read_text().replace(
        "  uri: public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1",
        f"  uri: {ECR_IMAGE}:v1\n  ray_version: 2.58.0"))
    result = runner.invoke(app, ["render", str(spec), "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert f"image: {ECR_IMAGE}:v1@{ecr}" in (tmp_path / "out" / "k8s" / "20-raycluster.yaml").read_text()
    assert "warning" not in result.stderr


def test_render_warns_once_and_uses_the_pinned_tag_without_a_digest(tmp_path):
    result = runner.invoke(app, ["render", str(REFERENCE), "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(warnings) == 1 and warnings[0].startswith("warning: image not pinned by digest"), result.stderr
    assert PINNED_DLC in warnings[0]
    assert f"image: {PINNED_DLC}\n" in (tmp_path / "out" / "k8s" / "20-raycluster.yaml").read_text()
