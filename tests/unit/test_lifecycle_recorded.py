"""Parsing recorded real outputs of eksctl, helm and kubectl (sources: tests/fixtures/recorded/README.md)."""

from __future__ import annotations

import json
from pathlib import Path

from trainlift.ops.eksctl import parse_clusters, parse_nodegroups
from trainlift.ops.kube import Release, parse_helm_list, parse_names, parse_nodes, parse_raycluster

RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "recorded"


def read(name: str) -> str:
    return (RECORDED / name).read_text()


def test_every_recording_is_named_in_the_readme():
    readme = read("README.md")
    for path in RECORDED.iterdir():
        if path.name != "README.md":
            assert f"`{path.name}`" in readme, path.name


def test_eksctl_get_cluster_listing():
    assert parse_clusters(read("eksctl-get-cluster.json")) == {"test-1": None, "test-3": None}


def test_eksctl_get_cluster_while_creating():
    assert parse_clusters(read("eksctl-get-cluster-creating.yaml")) == {"ridiculous-hideout-1549472274": "CREATING"}


def test_eksctl_get_cluster_tolerates_a_shell_prompt_marker():
    assert parse_clusters(read("eksctl-get-cluster.json") + "%") == {"test-1": None, "test-3": None}


def test_eksctl_get_nodegroup_old_and_managed():
    old = parse_nodegroups(read("eksctl-get-nodegroup.json"))["one-node-group"]
    assert (old.status, old.desired, old.instance_types) == ("UNKNOWN", 1, ("t2.small",))
    managed = parse_nodegroups(read("eksctl-get-nodegroup-managed.yaml"))["vmga-nonprod"]
    assert (managed.status, managed.desired, managed.instance_types) == ("ACTIVE", 2, ("t3.medium",))


def test_helm_list():
    first = parse_helm_list(read("helm-list.yaml"))["test1"]
    assert first == Release("test1", "default", "deployed", "abc-hello-0.1.0+rc-1.2.0-19", "1.16.0")
    assert first.version == "0.1.0+rc-1.2.0-19"
    second = parse_helm_list(read("helm-list-2.yaml"))["alpine-cicd-0-9880308374"]
    assert second.version == "9.9.9-9" and second.app_version == "2020.11"
    assert parse_helm_list("[]") == {} and parse_helm_list("") == {}


def test_chart_versions_of_the_pinned_charts():
    assert Release("a", "n", "deployed", "aws-efa-k8s-device-plugin-v0.5.32").version == "v0.5.32"
    assert Release("a", "n", "deployed", "kuberay-operator-1.4.0").version == "1.4.0"


def test_kubectl_get_nodes():
    [node] = parse_nodes(read("kubectl-get-nodes.json"))
    assert node.name == "ip-10-0-10-170.ec2.internal" and node.ready
    assert (node.instance_type, node.zone, node.group) == ("t3.small", "us-east-1a", "ecommerce-dev-node-group")
    assert (node.gpus, node.efa, node.role) == (0, 0, None)


def test_kubectl_get_nodes_with_device_plugins():
    # Derived from the recording: the two keys the NVIDIA and EFA device plugins add to a GPU node.
    data = json.loads(read("kubectl-get-nodes.json"))
    item = data["items"][0]
    item["status"]["allocatable"].update({"nvidia.com/gpu": "4", "vpc.amazonaws.com/efa": "1"})
    item["metadata"]["labels"].update({"role": "gpu-worker", "trainlift.io/worker-group": "gpu-workers"})
    [node] = parse_nodes(json.dumps(data))
    assert (node.gpus, node.efa, node.role, node.group) == (4, 1, "gpu-worker", "gpu-workers")


def test_names_and_raycluster_state():
    assert parse_names(read("kubectl-get-nodes.json")) == {"ip-10-0-10-170.ec2.internal"}
    rc = json.dumps({"metadata": {"name": "ray-train", "annotations": {"trainlift.io/spec-sha256": "h1"}},
                     "status": {"state": "ready"}})
    pods = json.dumps({"items": [
        {"metadata": {"labels": {"ray.io/node-type": "head"}},
         "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}},
        {"metadata": {"labels": {"ray.io/node-type": "worker"}}, "status": {"phase": "Running"}},
        {"metadata": {"labels": {"ray.io/node-type": "worker"}}, "status": {"phase": "Pending"}},
    ]})
    state = parse_raycluster(rc, pods)
    assert (state.exists, state.spec_hash, state.state, state.head_ready, state.workers_running) == (
        True, "h1", "ready", True, 1)
    assert not parse_raycluster(None, "[]").exists
