"""The planner on a table of observed states, for up and for down. Pure: no server, no tool."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from trainlift.cloud.eks_state import NodeGroupInfo
from trainlift.config.cluster import cluster_spec_from_yaml
from trainlift.ops.kube import Node, RayState, Release
from trainlift.ops.placement import Placement, place, resolve_spec
from trainlift.ops.plan import Files, Observed, plan_down, plan_up
from trainlift.ops.preflight import OWNER_TAG

REPO = Path(__file__).resolve().parents[2]
SPEC = cluster_spec_from_yaml((REPO / "examples" / "cluster-reference.yaml").read_text())
FILES = Files(".trainlift/ray-train", raycluster_hash="h1")
TAGS = {OWNER_TAG: "ray-train"}  # what trainlift puts on a cluster it creates
PLACED = {"gpu-workers": Placement("gpu-workers", "us-east-2a", "pinned in the spec; offered there")}

GROUPS = {
    "system-nodes": NodeGroupInfo("system-nodes", "ACTIVE", 1, ("m7i.xlarge",), ("us-east-2a",)),
    "gpu-workers": NodeGroupInfo("gpu-workers", "ACTIVE", 2, ("g6.12xlarge",), ("us-east-2a",)),
}
SYSTEM_NODE = Node("ip-1", "system", None, "m7i.xlarge", "us-east-2a", True, 0, 0)
BARE = (SYSTEM_NODE, *(Node(f"ip-{i}", "gpu-worker", "gpu-workers", "g6.12xlarge", "us-east-2a", True, 0, 0)
                       for i in (2, 3)))
READY = (SYSTEM_NODE, *(Node(f"ip-{i}", "gpu-worker", "gpu-workers", "g6.12xlarge", "us-east-2a", True, 4, 1)
                        for i in (2, 3)))
RELEASES = {
    "kuberay-operator": Release("kuberay-operator", "kuberay-operator", "deployed", "kuberay-operator-1.7.0"),
    "nvidia-device-plugin": Release("nvidia-device-plugin", "kube-system", "deployed", "nvidia-device-plugin-0.20.0"),
    "aws-efa-k8s-device-plugin": Release("aws-efa-k8s-device-plugin", "kube-system", "deployed",
                                         "aws-efa-k8s-device-plugin-v0.5.32"),
}
HEALTHY = Observed("ACTIVE", GROUPS, READY, RELEASES, True, frozenset({"default", "ray-train"}),
                   frozenset({"hf-token"}), RayState(True, "h1", "ready", True, 2), tags=TAGS,
                   daemonsets={"aws-efa-k8s-device-plugin": "aws-efa-k8s-device-plugin"})

STATES = {
    "nothing exists": Observed.nothing(),
    "control plane creating": Observed("CREATING", {}, tags=TAGS, unknown={"kubernetes": "the control plane is CREATING"}),
    "active, no node groups": Observed("ACTIVE", {}, (), {}, False, frozenset(), frozenset(), RayState(False),
                                       tags=TAGS, daemonsets={}),
    "node groups, no plugins": Observed("ACTIVE", GROUPS, BARE, {}, False, frozenset(), frozenset(), RayState(False),
                                        tags=TAGS, daemonsets={}),
    "everything healthy": HEALTHY,
    "deleting": Observed("DELETING", {}, tags=TAGS, unknown={"kubernetes": "the control plane is DELETING"}),
}

UP = {  # state -> {step key: action}; keys not listed are checked in the test bodies below
    "nothing exists": {"control-plane": "create", "nodegroup/system-nodes": "create",
                       "nodegroup/gpu-workers": "create", "helm/nvidia-device-plugin": "install",
                       "helm/aws-efa-k8s-device-plugin": "install", "helm/kuberay-operator": "install",
                       "namespace": "apply", "service-account": "create", "secret/hf-token": "nothing",
                       "raycluster": "apply", "wait/head": "wait", "wait/workers": "wait",
                       "wait/nodes/gpu-workers": "wait", "doctor": "check"},
    "control plane creating": {"control-plane": "wait", "nodegroup/system-nodes": "create",
                               "nodegroup/gpu-workers": "create", "helm/kuberay-operator": "install",
                               "raycluster": "apply", "wait/head": "wait"},
    "active, no node groups": {"control-plane": "nothing", "nodegroup/system-nodes": "create",
                               "nodegroup/gpu-workers": "create", "helm/nvidia-device-plugin": "install",
                               "namespace": "apply", "raycluster": "apply"},
    "node groups, no plugins": {"control-plane": "nothing", "nodegroup/system-nodes": "nothing",
                                "nodegroup/gpu-workers": "nothing", "helm/nvidia-device-plugin": "install",
                                "helm/aws-efa-k8s-device-plugin": "install", "helm/kuberay-operator": "install",
                                "wait/nodes/gpu-workers": "wait"},
    "everything healthy": {"control-plane": "nothing", "nodegroup/system-nodes": "nothing",
                           "nodegroup/gpu-workers": "nothing", "helm/nvidia-device-plugin": "nothing",
                           "helm/aws-efa-k8s-device-plugin": "nothing", "helm/kuberay-operator": "nothing",
                           "namespace": "nothing", "service-account": "apply", "secret/hf-token": "nothing",
                           "raycluster": "nothing", "wait/head": "nothing", "wait/workers": "nothing",
                           "wait/nodes/gpu-workers": "nothing", "doctor": "check"},
    "deleting": {"control-plane": "blocked"},
}

DOWN = {
    "nothing exists": {"raycluster": "nothing", "nodegroup/gpu-workers": "nothing",
                       "nodegroup/system-nodes": "nothing", "control-plane": "nothing"},
    "control plane creating": {"raycluster": "nothing", "nodegroup/gpu-workers": "nothing",
                               "control-plane": "delete"},
    "active, no node groups": {"raycluster": "nothing", "nodegroup/gpu-workers": "nothing",
                               "control-plane": "delete"},
    "node groups, no plugins": {"raycluster": "nothing", "nodegroup/gpu-workers": "delete",
                                "nodegroup/system-nodes": "delete", "control-plane": "delete"},
    "everything healthy": {"raycluster": "delete", "nodegroup/gpu-workers": "delete",
                           "nodegroup/system-nodes": "delete", "control-plane": "delete"},
    "deleting": {"raycluster": "nothing", "nodegroup/gpu-workers": "nothing", "control-plane": "wait"},
}


def actions(plan) -> dict[str, str]:
    return {s.key: s.action for s in plan.steps}


def commands(plan, key: str) -> list[str]:
    return [op.text() for s in plan.steps if s.key == key for op in s.ops]


@pytest.mark.parametrize("state", list(STATES))
def test_up(state):
    plan = plan_up(SPEC, STATES[state], PLACED, FILES)
    got = actions(plan)
    for key, action in UP[state].items():
        assert got[key] == action, f"{state}: {key}"
    assert plan.to_dict()["blocked"] == (state == "deleting")


@pytest.mark.parametrize("state", list(STATES))
def test_down(state):
    plan = plan_down(SPEC, STATES[state], FILES)
    got = actions(plan)
    for key, action in DOWN[state].items():
        assert got[key] == action, f"{state}: {key}"
    assert [s.key for s in plan.steps] == ["tools", "ownership", "raycluster", "add-ons", "nodegroup/gpu-workers",
                                           "nodegroup/system-nodes", "control-plane"]


def test_up_carries_the_exact_commands():
    plan = plan_up(SPEC, Observed.nothing(), PLACED, FILES)
    assert commands(plan, "control-plane") == [
        "eksctl create cluster -f .trainlift/ray-train/eksctl.yaml --without-nodegroup"]
    assert commands(plan, "nodegroup/gpu-workers") == [
        "eksctl create nodegroup -f .trainlift/ray-train/eksctl.yaml --include gpu-workers --install-nvidia-plugin=false"]
    crds, kuberay = commands(plan, "helm/kuberay-operator")
    # Helm never upgrades a chart's crds/ folder: KubeRay's CRDs at the pinned version go first, server-side.
    assert crds == ("helm show crds .trainlift/ray-train/charts/kuberay-operator-1.7.0.tgz "
                    "> .trainlift/ray-train/charts/kuberay-operator-1.7.0-crds.yaml && kubectl --kubeconfig "
                    ".trainlift/ray-train/kubeconfig apply --server-side --force-conflicts -f "
                    ".trainlift/ray-train/charts/kuberay-operator-1.7.0-crds.yaml")
    assert kuberay.startswith("helm upgrade --install kuberay-operator "
                              ".trainlift/ray-train/charts/kuberay-operator-1.7.0.tgz --namespace kuberay-operator")
    assert "--values .trainlift/ray-train/helm/kuberay-operator.values.yaml" in kuberay and "--wait" in kuberay
    assert commands(plan, "raycluster") == [
        "check that every Ray pod fits a node of its group, on the nodes' .status.allocatable",
        "kubectl --kubeconfig .trainlift/ray-train/kubeconfig apply --server-side --field-manager=trainlift "
        "-f .trainlift/ray-train/k8s/20-raycluster.yaml"]
    doctor = commands(plan, "doctor")[0]
    # The dashboard, not Ray Client: the probe runs as a job on the head, whatever the laptop's Ray and Python.
    assert "port-forward svc/ray-train-head-svc 18265:8265" in doctor
    # With S3 storage, every node also probes the run storage with the pods' own role (doctor/storage.py).
    assert doctor.endswith("trainlift doctor --address http://127.0.0.1:18265 --expect-fabric efa "
                           "--storage s3://my-trainlift-checkpoints/ray-train")
    assert "AZ us-east-2a" in next(s for s in plan.steps if s.key == "nodegroup/gpu-workers").observed


def test_creating_control_plane_is_waited_for():
    plan = plan_up(SPEC, STATES["control plane creating"], PLACED, FILES)
    step = next(s for s in plan.steps if s.key == "control-plane")
    assert [op.until for op in step.ops] == ["control-plane=ACTIVE"]
    assert "aws eks wait cluster-active --name ray-train --region us-east-2" in step.ops[0].text()


def test_an_old_chart_is_upgraded():
    old = dict(RELEASES, **{"kuberay-operator": Release("kuberay-operator", "kuberay-operator", "deployed",
                                                        "kuberay-operator-1.4.0")})
    seen = replace(HEALTHY, releases=old)
    plan = plan_up(SPEC, seen, PLACED, FILES)
    assert actions(plan)["helm/kuberay-operator"] == "install"
    assert "pinned 1.7.0" in next(s for s in plan.steps if s.key == "helm/kuberay-operator").observed


@pytest.mark.parametrize("status", ["CREATE_FAILED", "DEGRADED", "DELETE_FAILED"])
def test_broken_node_group_blocks_with_the_fix(status):
    groups = dict(GROUPS, **{"gpu-workers": NodeGroupInfo("gpu-workers", status, 2, ("g6.12xlarge",), (),
                                                          ("AsgInstanceLaunchFailures: InsufficientInstanceCapacity",))})
    plan = plan_up(SPEC, Observed("ACTIVE", groups, READY, RELEASES, True, tags=TAGS), PLACED, FILES)
    step = plan.blocked[0]
    assert step.key == "nodegroup/gpu-workers" and "InsufficientInstanceCapacity" in step.note
    assert step.fix.startswith("eksctl delete nodegroup --cluster ray-train --region us-east-2 --name gpu-workers")


def test_capacity_problem_blocks_before_anything_is_created():
    placed = {"gpu-workers": Placement("gpu-workers", "us-east-2a", "blocked", blocking="vCPU quota shortfall: ...",
                                       fix="aws service-quotas request-service-quota-increase ...")}
    plan = plan_up(SPEC, Observed.nothing(), placed, FILES)
    assert [s.key for s in plan.blocked] == ["nodegroup/gpu-workers"]
    assert plan.blocked[0].fix.startswith("aws service-quotas")


def test_unknown_control_plane_blocks_up():
    plan = plan_up(SPEC, Observed(None, unknown={"eks": "AccessDeniedException"}), PLACED, FILES)
    step = next(s for s in plan.blocked if s.key == "control-plane")
    assert "AccessDeniedException" in step.observed


def test_required_secret_is_waited_for_not_invented():
    spec = SPEC.model_copy(update={"secrets": [SPEC.secrets[0].model_copy(update={"optional": False})]})
    plan = plan_up(spec, Observed.nothing(), PLACED, FILES)
    step = next(s for s in plan.steps if s.key == "secret/hf-token")
    assert step.action == "wait" and "create secret generic hf-token --from-literal=token=..." in step.fix


def test_down_keep_control_plane_and_busy_groups():
    groups = dict(GROUPS, **{"gpu-workers": NodeGroupInfo("gpu-workers", "UPDATING", 2, (), ())})
    plan = plan_down(SPEC, Observed("ACTIVE", groups, READY, RELEASES, True, raycluster=RayState(False), tags=TAGS),
                     FILES, keep_control_plane=True)
    got = actions(plan)
    assert got["control-plane"] == "nothing" and got["nodegroup/system-nodes"] == "delete"
    busy = next(s for s in plan.steps if s.key == "nodegroup/gpu-workers")
    assert [op.kind for op in busy.ops] == ["wait", "run"] and busy.ops[0].until == "nodegroup/gpu-workers=settled"
    assert commands(plan, "nodegroup/system-nodes") == [
        "eksctl delete nodegroup --cluster ray-train --region us-east-2 --name system-nodes --wait"]


def test_down_deletes_the_control_plane_last():
    plan = plan_down(SPEC, HEALTHY, FILES)
    assert [s.key for s in plan.todo] == ["raycluster", "nodegroup/gpu-workers", "nodegroup/system-nodes",
                                          "control-plane"]
    assert commands(plan, "control-plane") == ["eksctl delete cluster --name ray-train --region us-east-2 --wait"]


def test_placement_pins_unpinned_groups_and_lists_cluster_zones():
    data = SPEC.model_dump()
    data["availability_zones"] = []
    data["workers"][0]["availability_zones"] = []
    spec = type(SPEC).model_validate(data)
    placed = {"gpu-workers": Placement("gpu-workers", "us-east-2b", "highest spot placement score")}
    resolved = resolve_spec(spec, placed, ["us-east-2a", "us-east-2b", "us-east-2c"], ["us-east-2a", "us-east-2c"])
    assert resolved.workers[0].availability_zones == ["us-east-2b"]
    assert resolved.availability_zones == ["us-east-2b", "us-east-2a"]
    assert place(spec, {}, GROUPS)["gpu-workers"].zone == "us-east-2a"
