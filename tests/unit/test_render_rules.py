"""Each validation rule fires on a spec built to break it, and names the field path."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from trainlift.config.cluster import cluster_spec_from_yaml, parse_cluster_spec
from trainlift.errors import SpecError
from trainlift.render import render_cluster
from trainlift.render.rules import cluster_problems, looks_secret

BASE: dict[str, Any] = {
    "name": "train",
    "availability_zones": ["us-east-2a", "us-east-2b"],
    "workers": [{"instance_type": "g6.12xlarge", "count": 2, "availability_zones": ["us-east-2a"]}],
}


def data(**changes: Any) -> dict[str, Any]:
    out = copy.deepcopy(BASE)
    worker = changes.pop("worker", None)
    if worker:
        out["workers"][0].update(worker)
    out.update(changes)
    return out


def render_error(**changes: Any) -> SpecError:
    with pytest.raises(SpecError) as info:
        render_cluster(parse_cluster_spec(data(**changes)))
    return info.value


def parse_error(**changes: Any) -> SpecError:
    with pytest.raises(SpecError) as info:
        parse_cluster_spec(data(**changes))
    return info.value


def test_the_base_spec_is_clean():
    assert cluster_problems(parse_cluster_spec(data())) == []


def test_efa_group_spanning_several_azs():
    err = render_error(worker={"availability_zones": ["us-east-2a", "us-east-2b"]})
    assert err.message.startswith("workers[0].availability_zones: an EFA node group needs exactly one AZ")
    assert "spans 2 AZs (us-east-2a, us-east-2b)" in err.message
    assert "trainlift capacity g6.12xlarge --region us-east-2" in (err.hint or "")


def test_efa_group_without_an_az():
    err = render_error(worker={"availability_zones": []})
    assert "workers[0].availability_zones: an EFA node group needs exactly one AZ" in err.message
    assert "sets no AZ" in err.message


def test_efa_groups_in_different_azs():
    err = render_error(workers=[
        {"name": "a", "instance_type": "p5.48xlarge", "availability_zones": ["us-east-2a"]},
        {"name": "b", "instance_type": "p5.48xlarge", "availability_zones": ["us-east-2b"]},
    ])
    assert "workers[1].availability_zones: EFA groups must share one AZ" in err.message


def test_efa_fabric_on_an_instance_without_efa():
    err = render_error(fabric="efa", worker={"instance_type": "g6.4xlarge"})
    assert err.message.startswith("workers[0].instance_type: fabric is efa but g6.4xlarge has no EFA")
    assert "fabric: socket" in (err.hint or "")


def test_more_gpus_per_worker_than_the_instance_has():
    err = render_error(worker={"gpus": 8})
    assert err.message.startswith("workers[0].gpus: 8 GPUs per worker but g6.12xlarge has 4")


def test_ray_version_differs_from_the_image():
    err = render_error(ray_version="2.57.0")
    assert err.message.startswith("ray_version: 2.57.0 differs from the image's Ray 2.58.0")


def test_image_ray_version_contradicts_a_known_image():
    err = render_error(image={"ray_version": "2.40.0"})
    assert "image.ray_version: 2.40.0, but public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1 ships Ray 2.58.0" in err.message


def test_unknown_image_needs_its_ray_version():
    err = parse_error(image={"uri": "example.com/ray:custom"})
    assert err.message.startswith("image.ray_version: required for example.com/ray:custom")
    spec = parse_cluster_spec(data(image={"uri": "example.com/ray:custom", "ray_version": "2.60.0"}))
    assert spec.ray_version == "2.60.0"


def test_secret_value_written_inline():
    err = render_error(secrets=[{"env": "HF_TOKEN", "secret": "hf-token", "key": "token", "value": "hf_abc"}])
    assert err.message.startswith("secrets[0].value: secret value written inline")
    assert "kubectl -n ray-train create secret generic hf-token" in (err.hint or "")


@pytest.mark.parametrize("name, value", [
    ("HF_TOKEN", "hf_abcdefghijklmnopqrstuvwx"),
    ("WANDB_API_KEY", "0123456789"),
    ("AWS_SECRET_ACCESS_KEY", "abc"),
    ("SOME_SETTING", "hf_abcdefghijklmnopqrstuvwxyz012345"),
    ("ID", "AKIAABCDEFGHIJKLMNOP"),
])
def test_secret_in_plain_env(name, value):
    err = render_error(env={name: value})
    assert err.message.startswith(f"env.{name}: looks like a secret value written inline")
    assert "secrets:" in (err.hint or "")


@pytest.mark.parametrize("name, value", [
    ("TOKENIZERS_PARALLELISM", "false"), ("NCCL_DEBUG", "WARN"), ("HF_TOKEN", ""), ("KEY_FIELD", "text"),
])
def test_plain_env_that_is_not_a_secret(name, value):
    assert not looks_secret(name, value)


def test_secret_and_env_clash():
    err = render_error(env={"HF_HOME": "/cache"},
                       secrets=[{"env": "HF_HOME", "secret": "s", "key": "k"}])
    assert "secrets[0].env: HF_HOME is also set in env" in err.message


def test_worker_az_outside_the_cluster_azs():
    err = render_error(worker={"availability_zones": ["us-east-2c"]})
    assert "workers[0].availability_zones: us-east-2c is not one of the cluster's availability_zones" in err.message


def test_worker_az_of_another_region():
    err = render_error(worker={"availability_zones": ["us-west-2a"]})
    assert "workers[0].availability_zones: us-west-2a is not an AZ of us-east-2" in err.message


def test_pinned_azs_need_cluster_azs():
    err = render_error(availability_zones=[])
    assert "availability_zones: worker groups pin us-east-2a" in err.message


def test_cluster_needs_two_azs():
    err = render_error(availability_zones=["us-east-2a"])
    assert "availability_zones: EKS needs at least two AZs" in err.message


def test_duplicate_and_reserved_names():
    err = render_error(workers=[
        {"name": "gpu", "instance_type": "g6.12xlarge", "availability_zones": ["us-east-2a"]},
        {"name": "gpu", "instance_type": "g6.12xlarge", "availability_zones": ["us-east-2a"],
         "labels": {"role": "mine"}},
    ])
    assert "workers[1].name: 'gpu' is already the name of workers[0]" in err.message
    assert "workers[1].labels.role: is set by trainlift" in err.message


def test_every_problem_is_reported_on_one_line():
    err = render_error(ray_version="2.1.0", worker={"gpus": 9})
    assert "\n" not in err.one_line()
    assert "workers[0].gpus" in err.message and "ray_version" in err.message


@pytest.mark.parametrize("changes, expected", [
    ({"worker": {"gpu_count": 4}}, "workers[0].gpu_count: unknown key"),
    ({"worker": {"instance_type": "p9.huge"}}, "workers[0].instance_type: 'p9.huge' is not in the hardware catalog"),
    ({"worker": {"instance_type": "m7i.xlarge"}}, "workers[0].instance_type: m7i.xlarge is not a GPU instance type"),
    ({"system": {"instance_type": "z1.tiny"}}, "system.instance_type: 'z1.tiny' is not in the hardware catalog"),
    ({"worker": {"count": 0}}, "workers[0].count: Input should be greater than or equal to 1"),
    ({"fabric": "infiniband"}, "fabric: Input should be 'efa' or 'socket'"),
    ({"storage": {}}, "storage: set exactly one of storage.s3 or storage.fsx"),
    ({"storage": {"s3": {"uri": "https://bucket"}}}, "storage.s3.uri: String should match pattern"),
    ({"workers": []}, "workers: List should have at least 1 item"),
    ({"name": "Bad_Name"}, "name: String should match pattern"),
])
def test_spec_errors_name_the_field_path(changes, expected):
    assert parse_error(**changes).message.startswith(expected)


def test_yaml_errors_name_the_line():
    with pytest.raises(SpecError, match=r"^c\.yaml:2: not valid YAML"):
        cluster_spec_from_yaml("name: x\nworkers: [a: b: c]\n", source="c.yaml")
    with pytest.raises(SpecError, match=r"^c\.yaml: a cluster spec is a mapping"):
        cluster_spec_from_yaml("- a\n", source="c.yaml")
