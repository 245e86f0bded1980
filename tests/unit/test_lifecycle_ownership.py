"""trainlift tags what it creates, and neither adopts nor deletes an untagged cluster without --force. Pure."""

from __future__ import annotations

from pathlib import Path

import yaml

from trainlift.cloud.eks_state import NodeGroupInfo, StackInfo
from trainlift.config.cluster import cluster_spec_from_yaml
from trainlift.ops import lifecycle
from trainlift.ops.kube import RayState
from trainlift.ops.placement import Placement
from trainlift.ops.plan import Files, Observed, plan_down, plan_up
from trainlift.ops.preflight import OWNER_TAG

REPO = Path(__file__).resolve().parents[2]
SPEC = cluster_spec_from_yaml((REPO / "examples" / "cluster-reference.yaml").read_text())
FILES = Files(".trainlift/ray-train", raycluster_hash="h1")
PLACED = {"gpu-workers": Placement("gpu-workers", "us-east-2a", "pinned")}
ARN = "arn:aws:eks:us-east-2:123456789012:cluster/ray-train"
GROUPS = {"system-nodes": NodeGroupInfo("system-nodes", "ACTIVE", 1, ("m7i.xlarge",), ("us-east-2a",))}


def someone_elses(tags: dict[str, str] | None = None) -> Observed:
    return Observed("ACTIVE", GROUPS, (), {}, True, frozenset(), frozenset(), RayState(False),
                    tags=tags if tags is not None else {"team": "search"}, cluster_arn=ARN, daemonsets={})


def test_the_rendered_eksctl_config_tags_the_cluster(tmp_path):
    lifecycle._render(SPEC, str(tmp_path), write=True)
    config = yaml.safe_load((tmp_path / "eksctl.yaml").read_text())
    assert config["metadata"]["tags"] == {OWNER_TAG: "ray-train"}


def test_down_refuses_a_cluster_trainlift_did_not_create():
    plan = plan_down(SPEC, someone_elses(), FILES)
    [blocked] = plan.blocked
    assert blocked.key == "ownership" and blocked.observed == "exists without the tag"
    assert "--force" in blocked.fix


def test_down_refuses_a_cluster_tagged_for_another_spec():
    assert plan_down(SPEC, someone_elses({OWNER_TAG: "other-cluster"}), FILES).blocked


def test_down_with_force_deletes_it():
    plan = plan_down(SPEC, someone_elses(), FILES, force=True)
    assert not plan.blocked and next(s for s in plan.steps if s.key == "control-plane").action == "delete"


def test_up_refuses_to_adopt_without_force_and_tags_it_with_force():
    assert [s.key for s in plan_up(SPEC, someone_elses(), PLACED, FILES).blocked] == ["ownership"]
    step = next(s for s in plan_up(SPEC, someone_elses(), PLACED, FILES, force=True).steps if s.key == "ownership")
    assert step.action == "apply" and [op.kind for op in step.ops] == ["tag"]
    assert step.ops[0].text() == f"aws eks tag-resource --resource-arn {ARN} --tags {OWNER_TAG}=ray-train"


def test_unreadable_tags_block_too():
    seen = Observed("ACTIVE", GROUPS, tags=None, unknown={"tags": "eks:DescribeCluster: AccessDeniedException"})
    blocked = plan_down(SPEC, seen, FILES).blocked[0]
    assert blocked.key == "ownership" and "AccessDeniedException" in blocked.observed


def test_a_tagged_cluster_and_a_new_one_need_no_force():
    assert not plan_down(SPEC, someone_elses({OWNER_TAG: "ray-train"}), FILES).blocked
    assert not plan_up(SPEC, Observed.nothing(), PLACED, FILES).blocked


def test_an_untagged_stack_left_behind_is_not_deleted_without_force():
    seen = Observed("ABSENT", {}, stack=StackInfo("eksctl-ray-train-cluster", "ROLLBACK_COMPLETE", {}), tags={})
    assert [s.key for s in plan_down(SPEC, seen, FILES).blocked] == ["ownership"]
