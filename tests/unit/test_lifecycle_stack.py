"""A failed `eksctl create cluster` leaves its CloudFormation stack with no EKS cluster: `up` deletes it
before creating again, `down` deletes it. Pure; reading the stack through the AWS API is tested against
moto in tests/integration/test_cluster_moto.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainlift.cloud.eks_state import StackInfo
from trainlift.config.cluster import cluster_spec_from_yaml
from trainlift.ops.placement import Placement
from trainlift.ops.plan import Files, Observed, plan_down, plan_up
from trainlift.ops.preflight import OWNER_TAG

REPO = Path(__file__).resolve().parents[2]
SPEC = cluster_spec_from_yaml((REPO / "examples" / "cluster-reference.yaml").read_text())
FILES = Files(".trainlift/ray-train", raycluster_hash="h1")
PLACED = {"gpu-workers": Placement("gpu-workers", "us-east-2a", "pinned")}
TAGS = {OWNER_TAG: "ray-train", "alpha.eksctl.io/cluster-name": "ray-train"}


def left_behind(status: str) -> Observed:
    stack = StackInfo("eksctl-ray-train-cluster", status, TAGS)
    return Observed("ABSENT", {}, (), {}, False, frozenset(), frozenset(), stack=stack, tags=TAGS, daemonsets={})


def control(plan):
    return next(s for s in plan.steps if s.key == "control-plane")


@pytest.mark.parametrize("status", ["ROLLBACK_COMPLETE", "CREATE_FAILED", "ROLLBACK_FAILED", "DELETE_FAILED"])
def test_up_deletes_a_failed_stack_then_creates(status):
    step = control(plan_up(SPEC, left_behind(status), PLACED, FILES))
    assert step.action == "create" and f"stack eksctl-ray-train-cluster {status}" in step.observed
    assert [op.text() for op in step.ops] == [
        "eksctl delete cluster --name ray-train --region us-east-2 --wait",
        "eksctl create cluster -f .trainlift/ray-train/eksctl.yaml --without-nodegroup"]


def test_up_waits_for_a_stack_being_deleted_and_stops_for_one_being_created():
    step = control(plan_up(SPEC, left_behind("DELETE_IN_PROGRESS"), PLACED, FILES))
    assert [op.until or op.argv[1] for op in step.ops] == ["stack=absent", "create"]
    step = control(plan_up(SPEC, left_behind("CREATE_IN_PROGRESS"), PLACED, FILES))
    assert step.action == "blocked" and "run up again" in step.note


@pytest.mark.parametrize("status", ["ROLLBACK_COMPLETE", "DELETE_FAILED", "CREATE_COMPLETE"])
def test_down_deletes_the_stack_of_a_cluster_that_never_came_up(status):
    plan = plan_down(SPEC, left_behind(status), FILES)
    assert not plan.blocked and [s.key for s in plan.todo] == ["control-plane"]
    assert [op.text() for op in control(plan).ops] == ["eksctl delete cluster --name ray-train --region us-east-2 --wait"]


def test_down_with_no_stack_and_no_cluster_does_nothing():
    assert plan_down(SPEC, Observed.nothing(), FILES).todo == []
