"""What the rendered Ray pods carry for a real EKS run: the head's stop grace for a final checkpoint, no training
work on the head, hugepages for EFA, and an image that cannot move under a running cluster."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from trainlift import catalog
from trainlift.config.cluster import cluster_spec_from_yaml, parse_cluster_spec
from trainlift.doctor.nccl_log import NCCL_DEBUG_ENV
from trainlift.render import JobInputs, render_cluster
from trainlift.render.raycluster import render_raycluster
from trainlift.render.rayjob import render_rayjob

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

FLOATING = "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1"
PINNED = "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.1.0"
BASE: dict[str, Any] = {
    "name": "train",
    "availability_zones": ["us-east-2a", "us-east-2b"],
    "workers": [{"instance_type": "g6.12xlarge", "count": 2, "availability_zones": ["us-east-2a"]}],
}


def make(**changes: Any):
    data = copy.deepcopy(BASE)
    data["workers"][0].update(changes.pop("worker", {}))
    data.update(changes)
    return parse_cluster_spec(data)


def raycluster(spec) -> dict[str, Any]:
    return next(m.body for m in render_cluster(spec) if m.path == "k8s/20-raycluster.yaml")["spec"]


def head_env(spec) -> dict[str, str]:
    container = raycluster(spec)["headGroupSpec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def worker_resources(spec) -> dict[str, dict[str, str]]:
    return raycluster(spec)["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]


def job() -> JobInputs:
    return JobInputs(name="sft", spec_path="job.yaml", workers=8, working_dir="s3://b/code.zip",
                     trainlift_uri="s3://b/trainlift.zip", shutdown_after_finish=True)


# --- jobs stop: the head lets the driver write its final checkpoint -------------------------------------------------

def test_the_head_gives_a_stopped_job_time_for_its_checkpoint():
    """Ray SIGKILLs a stopped job's driver RAY_JOB_STOP_WAIT_TIME_S after SIGTERM (3 s unless set). A g6.12xlarge
    node holds up to 4 x 22888 MiB of sharded state: 60 s for the step in flight plus 77 s to write it at 10 Gb/s."""
    assert head_env(make())["RAY_JOB_STOP_WAIT_TIME_S"] == "137"


def test_the_stop_wait_grows_with_the_largest_node_and_keeps_its_floor():
    g6 = int(head_env(make())["RAY_JOB_STOP_WAIT_TIME_S"])
    mixed = make(workers=[
        {"name": "a", "instance_type": "g6.12xlarge", "count": 1, "availability_zones": ["us-east-2a"]},
        {"name": "b", "instance_type": "p5.48xlarge", "count": 1, "availability_zones": ["us-east-2a"]},
    ])
    p5 = int(head_env(mixed)["RAY_JOB_STOP_WAIT_TIME_S"])
    small = int(head_env(make(worker={"instance_type": "g6.4xlarge", "availability_zones": []},
                              availability_zones=[]))["RAY_JOB_STOP_WAIT_TIME_S"])
    assert p5 > g6 > small >= 60


def test_a_stop_wait_in_the_spec_env_wins():
    assert head_env(make(env={"RAY_JOB_STOP_WAIT_TIME_S": "900"}))["RAY_JOB_STOP_WAIT_TIME_S"] == "900"


def test_a_rayjob_with_its_own_cluster_carries_the_stop_wait():
    body = render_rayjob(make(), job())
    head = body["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {"name": "RAY_JOB_STOP_WAIT_TIME_S", "value": "137"} in head["env"]


# --- the head runs the driver, never training tasks -----------------------------------------------------------------

def test_the_head_offers_no_cpus_to_tasks():
    params = raycluster(make())["headGroupSpec"]["rayStartParams"]
    assert (params["num-cpus"], params["num-gpus"]) == ("0", "0")


# --- hugepages for EFA ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("instance_type", ["g6.12xlarge", "p4d.24xlarge", "p5.48xlarge"])
def test_efa_workers_request_the_hugepages_the_efa_driver_reserves(instance_type):
    resources = worker_resources(make(worker={"instance_type": instance_type}))
    assert resources["limits"]["hugepages-2Mi"] == resources["requests"]["hugepages-2Mi"] == "5120Mi"


def test_the_hugepages_figure_names_its_source():
    profile = catalog.lookup("p5.48xlarge")
    assert profile.efa_hugepages_mib == 5120
    assert "5128 2MiB Huge Pages" in profile.sources["efa_hugepages_mib"]
    assert catalog.lookup("g6.4xlarge").efa_hugepages_mib == 0


def test_socket_workers_request_no_hugepages():
    resources = worker_resources(make(fabric="socket", worker={"availability_zones": []}, availability_zones=[]))
    assert "hugepages-2Mi" not in resources["limits"]


# --- the image does not float ---------------------------------------------------------------------------------------

def test_a_floating_dlc_tag_renders_as_its_pinned_release():
    spec = make(image={"uri": FLOATING})
    cluster = raycluster(spec)
    images = [cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]]
    images += [g["template"]["spec"]["containers"][0]["image"] for g in cluster["workerGroupSpecs"]]
    images.append(render_rayjob(spec, job())["spec"]["submitterPodTemplate"]["spec"]["containers"][0]["image"])
    assert images == [PINNED] * 3


def test_a_digest_reference_is_rendered_as_given():
    digest = "sha256:" + "ab" * 32
    spec = make(image={"uri": f"{PINNED}@{digest}"})
    head = raycluster(spec)["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["image"] == f"{PINNED}@{digest}"
    assert spec.image.ray_version == "2.58.0"


def test_an_image_the_catalog_does_not_know_is_rendered_as_given():
    spec = make(image={"uri": "registry.example.com/team/ray:2026-05", "ray_version": "2.58.0"})
    assert raycluster(spec)["headGroupSpec"]["template"]["spec"]["containers"][0]["image"] == (
        "registry.example.com/team/ray:2026-05")


# --- NCCL logging: what the transport check reads, without per-collective noise --------------------------------------

@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("cluster-*.yaml")), ids=lambda p: p.name)
def test_example_workers_log_the_lines_the_transport_check_reads(example):
    """doctor's classifier needs NCCL's INIT and NET lines; NCCL_DEBUG=WARN would hide them, and INFO with every
    subsystem would log each collective."""
    spec = cluster_spec_from_yaml(example.read_text(), source=example.name)
    for group in render_raycluster(spec)["spec"]["workerGroupSpecs"]:
        env = {e["name"]: e.get("value") for e in group["template"]["spec"]["containers"][0]["env"]}
        assert env["NCCL_DEBUG"] == NCCL_DEBUG_ENV["NCCL_DEBUG"], example.name
        assert set(env["NCCL_DEBUG_SUBSYS"].split(",")) == {"INIT", "NET"}, example.name
