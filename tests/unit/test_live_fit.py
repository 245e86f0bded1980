"""`cluster up` checks render's scheduling again on the nodes' real `.status.allocatable` before it applies the
RayCluster: in the plan where the nodes have joined, and at apply time (after a first `up` created them).

No API server runs here. The nodes are `kubectl get nodes -o json` objects in kubectl's shape, their allocatable
as an EKS AL2023 node reports it (EC2 memory less what the kernel keeps, kube-reserved, eviction); a g6.12xlarge
worker's hugepages-2Mi is efa-config's pool (2,641 pages) and its ephemeral-storage the instance-store RAID0 (3,760 GB,
0.5% taken by the filesystem) less kube-reserved's 1Gi and the 10% nodefs eviction threshold, as nodeadm configures
the kubelet. The apply-time check runs the real subprocess path against a `kubectl` script that prints them."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import yaml

from trainlift.config.cluster import parse_cluster_spec
from trainlift.errors import TrainliftError
from trainlift.ops import apply_plan
from trainlift.cloud.eks_state import NodeGroupInfo
from trainlift.ops.kube import RayState, parse_nodes
from trainlift.ops.plan import Files, Observed, plan_up
from trainlift.ops.plan_kube import FIT_OP, live_fit_problems
from trainlift.render.eksctl import OWNER_TAG

ROOT = Path(__file__).resolve().parents[2]
SPEC = parse_cluster_spec(yaml.safe_load((ROOT / "examples" / "cluster-reference.yaml").read_text()))


def node(name: str, labels: dict, cpu: str, memory: str, gpus: int = 0, efa: int = 0) -> dict:
    allocatable = {"cpu": cpu, "memory": memory, "ephemeral-storage": "76224326324", "pods": "58"}
    if gpus:
        allocatable.update({"nvidia.com/gpu": str(gpus), "vpc.amazonaws.com/efa": str(efa), "hugepages-2Mi": "5282Mi",
                            "ephemeral-storage": "3366006258176", "pods": "234"})
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"topology.kubernetes.io/zone": "us-east-2a", **labels}},
            "status": {"allocatable": allocatable, "conditions": [{"type": "Ready", "status": "True"}]}}


def nodes_json(system_cpu: str = "3920m", system_memory: str = "14961564Ki") -> str:
    system = node("ip-10-0-1-10.us-east-2.compute.internal",
                  {"role": "system", "node.kubernetes.io/instance-type": "m7i.xlarge",
                   "eks.amazonaws.com/nodegroup": "system-nodes"}, system_cpu, system_memory)
    workers = [node(f"ip-10-0-2-{i}.us-east-2.compute.internal",
                    {"role": "gpu-worker", "trainlift.io/worker-group": "gpu-workers",
                     "node.kubernetes.io/instance-type": "g6.12xlarge"}, "47810m", "186478516Ki", 4, 1)
               for i in (11, 12)]
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": [system, *workers]})


def test_allocatable_is_read_from_kubectl():
    system = parse_nodes(nodes_json())[0]
    assert (system.cpu_m, system.mem_mib) == (3920, 14611)


def test_nodes_as_render_expects_them_let_the_raycluster_apply_after_the_check():
    assert live_fit_problems(SPEC, parse_nodes(nodes_json())) == []
    plan = plan_up(SPEC, lifecycle_observed(nodes_json()), {}, Files(".trainlift/ray-train"))
    [step] = [s for s in plan.steps if s.key == "raycluster"]
    assert [op.kind for op in step.ops] == ["fit", "run"]


def lifecycle_observed(text: str) -> Observed:
    """Both node groups ACTIVE with their nodes joined; no RayCluster yet."""
    groups = {"system-nodes": NodeGroupInfo("system-nodes", "ACTIVE", 1, ("m7i.xlarge",), ("us-east-2a",)),
              "gpu-workers": NodeGroupInfo("gpu-workers", "ACTIVE", 2, ("g6.12xlarge",), ("us-east-2a",))}
    return Observed("ACTIVE", groups, tuple(parse_nodes(text)), {}, True, frozenset({"ray-train"}),
                    frozenset({"hf-token"}), RayState(False), tags={OWNER_TAG: "ray-train"}, daemonsets={})


def test_a_system_node_with_less_cpu_than_render_assumed_blocks_the_raycluster_with_the_numbers():
    """3,800m allocatable (an AMI or kubelet config that reserves 200m instead of nodeadm's 80m) leaves 2,450m after
    the add-ons, operators, submitter and the margin for one more DaemonSet: the 2,500m head would stay Pending."""
    problems = live_fit_problems(SPEC, parse_nodes(nodes_json(system_cpu="3800m")))
    assert problems == ["the ray-head pod fits 0 of 1 m7i.xlarge node(s) as they are: node "
                        "ip-10-0-1-10.us-east-2.compute.internal CPU: allocatable 3800m, render expected 3920m; the pod "
                        "requests 2500m and 2450m is left after what lands there first"]
    plan = plan_up(SPEC, lifecycle_observed(nodes_json(system_cpu="3800m")), {}, Files(".trainlift/ray-train"))
    [step] = [s for s in plan.steps if s.key == "raycluster"]
    assert step.action == "blocked" and step.note == problems[0]


def test_the_apply_time_check_reads_the_nodes_that_joined_since_the_plan(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "nodes.json").write_text(nodes_json(system_memory="12000000Ki"))
    kubectl = bin_dir / "kubectl"
    kubectl.write_text(f"#!/bin/sh\ncat {tmp_path / 'nodes.json'}\n")
    kubectl.chmod(kubectl.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(TrainliftError) as caught:
        apply_plan._apply_op(FIT_OP, SPEC, Files(str(tmp_path)), None, print)
    assert "the ray-head pod fits 0 of 1 m7i.xlarge node(s) as they are" in caught.value.message
    assert "memory: allocatable 11719 MiB, render expected 14162 MiB" in caught.value.message
