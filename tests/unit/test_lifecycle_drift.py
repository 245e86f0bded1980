"""A changed spec is applied: node groups scaled in place or named for a replace, the service account's
policy re-applied, a changed RayCluster re-created, and KubeRay installed at the version of the CRD
schemas render checks against. Pure."""

from __future__ import annotations

import re
from pathlib import Path

from trainlift import catalog
from trainlift.cloud.eks_state import NodeGroupInfo
from trainlift.config.cluster import cluster_spec_from_yaml
from trainlift.ops.kube import RayState
from trainlift.ops.placement import Placement
from trainlift.ops.plan import Files, Observed, plan_up
from trainlift.ops.preflight import OWNER_TAG

REPO = Path(__file__).resolve().parents[2]
SPEC = cluster_spec_from_yaml((REPO / "examples" / "cluster-reference.yaml").read_text())
FILES = Files(".trainlift/ray-train", raycluster_hash="h1")
PLACED = {"gpu-workers": Placement("gpu-workers", "us-east-2a", "pinned")}
SYSTEM = NodeGroupInfo("system-nodes", "ACTIVE", 1, ("m7i.xlarge",), ("us-east-2a",))


def running(gpu: NodeGroupInfo, raycluster: RayState = RayState(True, "h1", "ready", True, 2)) -> Observed:
    return Observed("ACTIVE", {"system-nodes": SYSTEM, "gpu-workers": gpu}, (), {}, True,
                    frozenset({"ray-train"}), frozenset(), raycluster, tags={OWNER_TAG: "ray-train"},
                    daemonsets={})


def step(plan, key: str):
    return next(s for s in plan.steps if s.key == key)


def test_a_changed_count_is_scaled_in_place():
    plan = plan_up(SPEC, running(NodeGroupInfo("gpu-workers", "ACTIVE", 1, ("g6.12xlarge",), ("us-east-2a",))),
                   PLACED, FILES)
    group = step(plan, "nodegroup/gpu-workers")
    assert group.action == "apply" and "the spec says 2" in group.observed
    assert [op.text() for op in group.ops] == [
        "eksctl scale nodegroup --cluster ray-train --region us-east-2 --name gpu-workers "
        "--nodes 2 --nodes-min 2 --nodes-max 2 --wait"]


def test_a_changed_instance_type_or_az_needs_a_replace():
    gpu = NodeGroupInfo("gpu-workers", "ACTIVE", 2, ("g5.12xlarge",), ("us-east-2b",))
    plan = plan_up(SPEC, running(gpu), PLACED, FILES)
    [blocked] = plan.blocked
    assert blocked.key == "nodegroup/gpu-workers"
    assert "instance type g5.12xlarge -> g6.12xlarge" in blocked.note and "AZ us-east-2b -> us-east-2a" in blocked.note
    assert blocked.fix.startswith("eksctl delete nodegroup --cluster ray-train --region us-east-2 --name gpu-workers")


def test_an_unchanged_group_is_left_alone():
    gpu = NodeGroupInfo("gpu-workers", "ACTIVE", 2, ("g6.12xlarge",), ("us-east-2a",))
    assert step(plan_up(SPEC, running(gpu), PLACED, FILES), "nodegroup/gpu-workers").action == "nothing"


def test_an_existing_service_account_gets_its_policy_applied_again():
    gpu = NodeGroupInfo("gpu-workers", "ACTIVE", 2, ("g6.12xlarge",), ("us-east-2a",))
    account = step(plan_up(SPEC, running(gpu), PLACED, FILES), "service-account")
    assert [op.text() for op in account.ops] == [
        "eksctl update iamserviceaccount -f .trainlift/ray-train/eksctl.yaml --approve"]


def test_a_changed_raycluster_is_recreated_and_waited_for():
    gpu = NodeGroupInfo("gpu-workers", "ACTIVE", 2, ("g6.12xlarge",), ("us-east-2a",))
    plan = plan_up(SPEC, running(gpu, RayState(True, "old", "ready", True, 2)), PLACED, FILES)
    rc = step(plan, "raycluster")
    assert rc.action == "replace" and "running Ray jobs stop" in rc.note
    assert [op.kind for op in rc.ops] == ["run", "fit", "run"]  # the fit check right before the apply
    assert [op.argv[3:6] for op in rc.ops if op.kind == "run"] == [("-n", "ray-train", "delete"), (
        "apply", "--server-side", "--field-manager=trainlift")]
    assert step(plan, "wait/head").action == "wait" and step(plan, "wait/workers").action == "wait"


def test_kuberay_is_the_version_of_the_crd_schemas():
    schemas = {re.match(r"kuberay-v([\d.]+)-", p.name).group(1)
               for p in (REPO / "src" / "trainlift" / "render" / "schemas").glob("kuberay-v*.yaml")}
    assert schemas == {catalog.chart("kuberay-operator").version}

