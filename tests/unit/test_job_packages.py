"""What a job needs beyond the cluster image travels in its runtime_env, pinned to the releases the suite runs;
a runtime.pip line that would replace one of the image's own packages is refused in one line."""

from __future__ import annotations

import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from trainlift.catalog.packages import ImageLock, feature_packages, image_lock, parse_lock, runtime_pip
from trainlift.config.job import validate_job_spec
from trainlift.errors import SpecError

REPO = Path(__file__).resolve().parents[2]
DLC = "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1"


def spec(**sections):
    return validate_job_spec({"model": {"path": "m"}, "data": {"train": "t.jsonl"}, **sections})


def test_the_pins_are_the_extras_of_pyproject_and_what_the_suite_runs():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pinned = {r.name: str(r.specifier) for r in map(Requirement, extras["lora"] + extras["track"])}
    job = spec(model={"path": "m", "lora": {}}, run={"trackers": ["tensorboard", "mlflow"]})
    packages = feature_packages(job)
    assert {p.name: f"=={p.version}" for p in packages} == pinned
    assert all(version(p.name) == p.version for p in packages)


def test_the_dlc_lock_is_known_for_its_floating_and_release_tags():
    for tag in ("", "-v1", "-v1.1", "-v1.1.0", "-v1.0.0"):
        lock = image_lock(f"public.ecr.aws/deep-learning-containers/ray:train-ml-cuda{tag}")
        assert lock is not None and lock.packages["ray"] == "2.58.0" and lock.python == "3.13.12", tag
    lock = image_lock(DLC)
    assert {"torch", "nvidia-nccl-cu13", "flash-attn"} <= lock.gpu and "transformers" not in lock.gpu
    assert not {"peft", "mlflow", "mlflow-skinny", "tensorboard", "kubernetes-validate"} & set(lock.packages)
    assert image_lock("registry.example/my/ray:latest") is None


LIGER = "liger-kernel==0.6.4 --hash=sha256:" + "a" * 64
PEFT = "peft==0.21.2 --hash=sha256:" + "b" * 64


def requirements(lines: list[str]) -> list[str]:
    return [line.split(" --hash")[0] for line in lines]


def test_lora_and_trackers_bring_what_the_image_lacks_pinned():
    job = spec(model={"path": "m", "lora": {}}, run={"trackers": ["tensorboard"]},
               runtime={"pip": [LIGER, PEFT]})
    tensorboard = ["absl-py==2.5.1", "markdown==3.11.4", "tensorboard==2.21.0", "tensorboard-data-server==0.7.2",
                   "werkzeug==3.1.9"]
    assert requirements(runtime_pip(job, image_lock(DLC))) == [*tensorboard[:2], "peft==0.21.2", *tensorboard[2:],
                                                              "liger-kernel==0.6.4"]
    assert requirements(runtime_pip(job, None)) == requirements(runtime_pip(job, image_lock(DLC)))
    with_peft = ImageLock("x", {"peft": "0.21.2", "tensorboard": "2.21.0"}, frozenset(), ())
    assert runtime_pip(job, with_peft) == [LIGER, PEFT]
    assert runtime_pip(spec(), image_lock(DLC)) == []


def test_a_runtime_pip_line_that_would_replace_an_image_package_is_refused():
    with pytest.raises(SpecError, match=r"runtime.pip: torch==2.5.0 would replace the image's torch 2.13.0\+cu130"):
        runtime_pip(spec(runtime={"pip": ["torch==2.5.0"]}), image_lock(DLC))
    torch = "torch==2.13.0 --hash=sha256:" + "c" * 64
    assert runtime_pip(spec(runtime={"pip": [torch]}), image_lock(DLC)) == [torch]
    with pytest.raises(SpecError, match="runtime.pip: 'rm -rf /' is not a pip requirement"):
        spec(runtime={"pip": ["rm -rf /"]})


def test_a_lock_line_that_is_not_name_version_is_an_error():
    assert parse_lock("# python: 3.13.1\na==1\nb_c==2  # gpu\n").gpu == {"b-c"}
    with pytest.raises(ValueError, match="'a>=1' is not name==version"):
        parse_lock("a>=1\n", "x.txt")


def test_the_rendered_rayjob_installs_peft_for_a_lora_job(tmp_path, monkeypatch):
    from trainlift.config.cluster import cluster_spec_from_yaml
    from trainlift.render import JobInputs, render_cluster

    cluster = cluster_spec_from_yaml((REPO / "examples" / "cluster-reference.yaml").read_text())
    job = spec(model={"path": "m", "lora": {}})
    inputs = JobInputs(name="j", spec_path="job.yaml", working_dir="s3://my-trainlift-checkpoints/code/job.zip",
                       trainlift_uri="s3://my-trainlift-checkpoints/code/t.whl",
                       pip=tuple(runtime_pip(job, image_lock(cluster.image.uri))))
    rayjob = next(m for m in render_cluster(cluster, inputs) if m.kind == "RayJob")
    runtime_env = yaml.safe_load(yaml.safe_load(rayjob.text())["spec"]["runtimeEnvYAML"])
    assert requirements(runtime_env["pip"]["packages"]) == ["peft==0.21.2"]
    assert "--require-hashes" in runtime_env["pip"]["pip_install_options"]
