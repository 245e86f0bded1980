"""One owner per device plugin, checked at apply time.

NVIDIA: trainlift's Helm release; eksctl is told not to install its own, and an eksctl DaemonSet an
older run left is deleted. EFA: also the Helm release, which adopts the DaemonSet eksctl writes for
every efaEnabled node group (eksctl has no switch for it). The DaemonSet eksctl writes is recorded
from eksctl's source (tests/fixtures/recorded/eksctl-efa-device-plugin.yaml); the Helm-owned variant
adds, in code, the label and annotations Helm documents for ownership.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import yaml

from trainlift.cloud.eks_state import NodeGroupInfo
from trainlift.config.cluster import cluster_spec_from_yaml
from trainlift.ops import apply_plan, kube
from trainlift.ops.eksctl import create_nodegroup
from trainlift.ops.kube import Node, RayState, Release, parse_daemonsets
from trainlift.ops.placement import Placement
from trainlift.ops.plan import Files, Observed, Op, plan_up
from trainlift.ops.preflight import OWNER_TAG
from trainlift.ops.run import Completed

REPO = Path(__file__).resolve().parents[2]
RECORDED = REPO / "tests" / "fixtures" / "recorded"
SPEC = cluster_spec_from_yaml((REPO / "examples" / "cluster-reference.yaml").read_text())
GROUPS = {
    "system-nodes": NodeGroupInfo("system-nodes", "ACTIVE", 1, ("m7i.xlarge",), ("us-east-2a",)),
    "gpu-workers": NodeGroupInfo("gpu-workers", "ACTIVE", 2, ("g6.12xlarge",), ("us-east-2a",)),
}
SYSTEM_NODE = Node("ip-1", "system", None, "m7i.xlarge", "us-east-2a", True, 0, 0)
FILES = Files(".trainlift/ray-train", raycluster_hash="h1")
PLACED = {"gpu-workers": Placement("gpu-workers", "us-east-2a", "pinned")}
EFA = "aws-efa-k8s-device-plugin"
PINNED = {name: Release(name, "kube-system", "deployed", f"{name}-{version}") for name, version in (
    ("kuberay-operator", "1.7.0"), ("nvidia-device-plugin", "0.20.0"), (EFA, "v0.5.32"))}
HEALTHY = Observed("ACTIVE", GROUPS, (SYSTEM_NODE,), PINNED, True, frozenset(), frozenset(), RayState(False),
                   tags={OWNER_TAG: "ray-train"}, daemonsets={EFA: EFA})


def eksctl_daemonset() -> dict:
    return yaml.safe_load((RECORDED / "eksctl-efa-device-plugin.yaml").read_text())


def helm_owned(item: dict) -> dict:
    item = json.loads(json.dumps(item))
    item["metadata"]["labels"] = {"app.kubernetes.io/managed-by": "Helm"}
    item["metadata"]["annotations"] = {"meta.helm.sh/release-name": EFA, "meta.helm.sh/release-namespace": "kube-system"}
    return item


def step(plan, key: str):
    return next(s for s in plan.steps if s.key == key)


def test_eksctl_is_told_not_to_install_its_nvidia_plugin():
    assert "--install-nvidia-plugin=false" in create_nodegroup("eksctl.yaml", "gpu-workers")


def test_the_recorded_eksctl_daemonset_has_no_helm_owner():
    listing = json.dumps({"kind": "DaemonSetList", "items": [eksctl_daemonset()]})
    assert parse_daemonsets(listing) == {EFA: ""}
    assert parse_daemonsets(json.dumps({"items": [helm_owned(eksctl_daemonset())]})) == {EFA: EFA}


def test_plugins_advertised_by_eksctl_are_still_taken_over():
    """GPU nodes advertise GPUs and EFA through eksctl's DaemonSets: the Helm releases replace them."""
    gpu_nodes = tuple(Node(f"ip-{i}", "gpu-worker", "gpu-workers", "g6.12xlarge", "us-east-2a", True, 4, 1)
                      for i in (2, 3))
    seen = Observed("ACTIVE", GROUPS, (SYSTEM_NODE, *gpu_nodes), {}, True, frozenset(), frozenset(), RayState(False),
                    tags={OWNER_TAG: "ray-train"},
                    daemonsets={"nvidia-device-plugin-daemonset": "", EFA: "", "aws-node": ""})
    plan = plan_up(SPEC, seen, PLACED, FILES)
    nvidia = step(plan, "helm/nvidia-device-plugin")
    assert nvidia.action == "install" and [op.argv[:1] + op.argv[3:7] for op in nvidia.ops][0] == (
        "kubectl", "-n", "kube-system", "delete", "daemonset")
    assert "nvidia-device-plugin-daemonset" in nvidia.ops[0].argv and nvidia.ops[1].argv[:3] == ("helm", "upgrade", "--install")
    efa = step(plan, f"helm/{EFA}")
    assert efa.action == "install" and [op.kind for op in efa.ops] == ["adopt", "run"]
    assert efa.ops[0].text().startswith(f"if daemonset/kube-system/{EFA} exists and Helm release {EFA} does not own it:")
    assert '"meta.helm.sh/release-name":"aws-efa-k8s-device-plugin"' in efa.ops[0].argv[-1]


def test_a_new_cluster_adopts_the_efa_daemonset_after_its_node_groups():
    plan = plan_up(SPEC, Observed.nothing(), PLACED, FILES)
    keys = [s.key for s in plan.steps]
    assert keys.index("nodegroup/gpu-workers") < keys.index(f"helm/{EFA}")
    assert [op.kind for op in step(plan, f"helm/{EFA}").ops] == ["adopt", "run"]
    assert len(step(plan, "helm/nvidia-device-plugin").ops) == 1  # eksctl installed none


def test_a_healthy_helm_owned_cluster_has_nothing_to_do_until_a_node_group_is_created():
    assert step(plan_up(SPEC, HEALTHY, PLACED, FILES), f"helm/{EFA}").action == "nothing"
    groups = {k: v for k, v in GROUPS.items() if k != "gpu-workers"}
    plan = plan_up(SPEC, replace(HEALTHY, nodegroups=groups), PLACED, FILES)
    assert step(plan, "nodegroup/gpu-workers").action == "create"
    assert step(plan, f"helm/{EFA}").action == "install"


def _kubectl_lists(monkeypatch, item: dict) -> list[list[str]]:
    """kubectl answers with the given DaemonSet; `check` records what apply runs."""
    ran: list[list[str]] = []
    listing = json.dumps({"kind": "DaemonSetList", "items": [item]})
    monkeypatch.setattr(kube, "run", lambda cmd, timeout: Completed(tuple(cmd), 0, listing))
    monkeypatch.setattr(apply_plan, "check", lambda argv, *a, **k: ran.append(argv))
    return ran


def test_apply_adopts_only_a_daemonset_helm_does_not_own(monkeypatch):
    adopt = Op("adopt", tuple(kube.helm_adopt("kc", "daemonset", EFA, "kube-system", EFA)),
               until=f"daemonset/kube-system/{EFA}={EFA}")
    ran = _kubectl_lists(monkeypatch, eksctl_daemonset())
    apply_plan._apply_op(adopt, SPEC, FILES, aws=None, echo=print)  # type: ignore[arg-type]
    assert ran == [list(adopt.argv)]
    ran = _kubectl_lists(monkeypatch, helm_owned(eksctl_daemonset()))
    apply_plan._apply_op(adopt, SPEC, FILES, aws=None, echo=print)  # type: ignore[arg-type]
    assert ran == []
