"""`cluster up` on a Capacity Block: a group whose block has not started keeps 0 nodes and is not waited for; the `up`
after its start scales it to its count. EC2's view of the reservation is a `Reservation` as `Aws.reservation`
returns it (recorded responses in tests/unit/test_capacity_blocks.py). Pure."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from trainlift.cloud.eks_state import NodeGroupInfo
from trainlift.cloud.capacity import Reservation
from trainlift.config.cluster import cluster_spec_from_yaml
from trainlift.ops.kube import RayState
from trainlift.ops.placement import Placement
from trainlift.ops.plan import Files, Observed, plan_up
from trainlift.ops.preflight import OWNER_TAG

REPO = Path(__file__).resolve().parents[2]
SPEC = cluster_spec_from_yaml((REPO / "examples" / "cluster-p5.yaml").read_text())
[GROUP] = SPEC.workers
FILES = Files(".trainlift/ray-train-p5", raycluster_hash="h1")
PLACED = {GROUP.name: Placement(GROUP.name, "us-east-2a", "pinned")}
SYSTEM = NodeGroupInfo("system-nodes", "ACTIVE", 1, (SPEC.system.instance_type,), ("us-east-2a",))


def block(state: str) -> Reservation:
    return Reservation(GROUP.capacity_reservation_id, "us-east-2a", GROUP.count, GROUP.count, "2026-12-09T11:30:00Z",
                       GROUP.instance_type, state, "capacity-block", "2026-12-08T11:30:00Z")


def running(nodes_in_group: int, state: str) -> Observed:
    gpu = NodeGroupInfo(GROUP.name, "ACTIVE", nodes_in_group, (GROUP.instance_type,), ("us-east-2a",))
    return Observed("ACTIVE", {"system-nodes": SYSTEM, GROUP.name: gpu}, (), {}, True, frozenset({SPEC.namespace}),
                    frozenset(), RayState(True, "h1", "ready", True, 0), tags={OWNER_TAG: SPEC.name}, daemonsets={},
                    reservations={GROUP.capacity_reservation_id: block(state)})


def step(plan, key: str):
    return next(s for s in plan.steps if s.key == key)


def test_before_the_block_starts_the_group_stays_at_zero_and_is_not_waited_for():
    assert GROUP.capacity_block and GROUP.count == 2
    plan = plan_up(SPEC, running(0, "scheduled"), PLACED, FILES)
    assert step(plan, "nodegroup/" + GROUP.name).action == "nothing"
    nodes = step(plan, f"wait/nodes/{GROUP.name}")
    assert nodes.action == "nothing" and "scheduled, starts 2026-12-08T11:30:00Z" in nodes.observed
    assert step(plan, "wait/workers").title.startswith("0 Ray worker pods")
    assert not plan.blocked


def test_once_the_block_is_active_the_group_is_scaled_to_its_count_and_waited_for():
    plan = plan_up(SPEC, running(0, "active"), PLACED, FILES)
    group = step(plan, "nodegroup/" + GROUP.name)
    assert group.action == "apply"
    assert [op.text() for op in group.ops] == [
        f"eksctl scale nodegroup --cluster {SPEC.name} --region {SPEC.region} --name {GROUP.name} "
        "--nodes 2 --nodes-min 2 --nodes-max 2 --wait"]
    assert step(plan, f"wait/nodes/{GROUP.name}").action == "wait"


def test_a_block_ec2_says_nothing_about_is_not_launched_into():
    seen = replace(running(0, "active"), reservations={})
    assert step(plan_up(SPEC, seen, PLACED, FILES), "nodegroup/" + GROUP.name).action == "nothing"
