"""A failed `eksctl create nodegroup` leaves the group's CloudFormation stack with no EKS node group, and eksctl's
next create skips a group whose stack exists: `up` deletes the stack first, waits for one being deleted, and stops
for one eksctl is still working on.

On recorded CloudFormation states: the observation reads a DescribeStacks response served by botocore's Stubber from
tests/fixtures/recorded/, a response in the shape DescribeStacks returns (composed, its README says from what); no
CloudFormation runs here. The plans are pure.
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import pytest
from botocore.stub import Stubber
from typer.testing import CliRunner

from trainlift.cli import app
from trainlift.cloud.aws import Aws
from trainlift.cloud.capacity import Unknown
from trainlift.cloud.eks_state import ClusterInfo, NodeGroupInfo, StackInfo
from trainlift.config.cluster import cluster_spec_from_yaml
from trainlift.ops import apply_plan, lifecycle
from trainlift.ops.placement import Placement
from trainlift.ops.plan import Files, Observed, plan_up

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "examples" / "cluster-reference.yaml"
SPEC = cluster_spec_from_yaml(REFERENCE.read_text())
RECORDED = REPO / "tests" / "fixtures" / "recorded" / "cloudformation-describe-stacks-nodegroup-rollback-complete.json"
FILES = Files(".trainlift/ray-train", raycluster_hash="h1")
PLACED = {"gpu-workers": Placement("gpu-workers", "us-east-2a", "pinned")}
STACK = "eksctl-ray-train-nodegroup-gpu-workers"
SYSTEM = NodeGroupInfo("system-nodes", "ACTIVE", 1, ("m7i.xlarge",), ("us-east-2a",))
DELETE = "eksctl delete nodegroup --cluster ray-train --region us-east-2 --name gpu-workers --wait"
CREATE = ("eksctl create nodegroup -f .trainlift/ray-train/eksctl.yaml --include gpu-workers "
          "--install-nvidia-plugin=false")


def recorded_response() -> dict:
    """The recording as boto3 hands it over: timestamps parsed."""
    data = json.loads(RECORDED.read_text())
    for stack in data["Stacks"]:
        stack["CreationTime"] = datetime.fromisoformat(stack["CreationTime"].replace("Z", "+00:00"))
    return data


@pytest.fixture
def stubbed(stubbed_aws) -> tuple[Aws, Stubber]:
    return stubbed_aws("cloudformation")


def no_stack(stubber: Stubber, name: str) -> None:
    stubber.add_client_error("describe_stacks", service_error_code="ValidationError", http_status_code=400,
                             service_message=f"Stack with id {name} does not exist",
                             expected_params={"StackName": name})


def recorded_stack(stubbed) -> StackInfo:
    aws, stubber = stubbed
    stubber.add_response("describe_stacks", recorded_response(), {"StackName": STACK})
    return aws.nodegroup_stacks("ray-train", ["gpu-workers"])["gpu-workers"]


# --- observing ----------------------------------------------------------------------------------

def test_the_recorded_stack_is_read_by_name_and_a_group_without_one_is_left_out(stubbed):
    aws, stubber = stubbed
    stubber.add_response("describe_stacks", recorded_response(), {"StackName": STACK})
    no_stack(stubber, "eksctl-ray-train-nodegroup-system-nodes")
    found = aws.nodegroup_stacks("ray-train", ["gpu-workers", "system-nodes"])
    stubber.assert_no_pending_responses()
    assert list(found) == ["gpu-workers"]
    stack = found["gpu-workers"]
    assert (stack.name, stack.status) == (STACK, "ROLLBACK_COMPLETE")
    assert stack.tags["alpha.eksctl.io/nodegroup-name"] == "gpu-workers"
    assert stack.tags["alpha.eksctl.io/cluster-name"] == "ray-train"


def test_a_denied_lookup_is_unknown_not_a_crash(stubbed):
    aws, stubber = stubbed
    stubber.add_client_error("describe_stacks", service_error_code="AccessDenied", http_status_code=403,
                             service_message="User is not authorized to perform: cloudformation:DescribeStacks")
    found = aws.nodegroup_stacks("ray-train", ["gpu-workers"])
    assert isinstance(found, Unknown) and found.reason.startswith("cloudformation:DescribeStacks: AccessDenied")


class _Eks:
    """The EKS side of an observation: the control plane, the system group, no gpu-workers; records the stack
    lookups it is asked for."""

    def __init__(self, stacks: dict[str, StackInfo] | Unknown):
        self.stacks, self.asked = stacks, []

    def cluster(self, name):
        return ClusterInfo(name, "ACTIVE", "1.33", None, None)

    def nodegroups(self, cluster):
        return {"system-nodes": SYSTEM}

    def nodegroup_stacks(self, cluster, groups):
        self.asked.append(list(groups))
        return self.stacks


def test_only_the_groups_eks_does_not_list_are_looked_up(tmp_path, stubbed):
    eks = _Eks({"gpu-workers": recorded_stack(stubbed)})
    seen = lifecycle._observe(SPEC, Files(str(tmp_path)), eks)  # type: ignore[arg-type]
    assert eks.asked == [["gpu-workers"]]
    assert seen.nodegroup_stacks["gpu-workers"].status == "ROLLBACK_COMPLETE"


def test_an_unreadable_stack_is_named_and_the_group_planned_as_before(tmp_path):
    denied = _Eks(Unknown("cloudformation:DescribeStacks: AccessDenied"))
    seen = lifecycle._observe(SPEC, Files(str(tmp_path)), denied)  # type: ignore[arg-type]
    assert seen.nodegroup_stacks == {} and seen.unknown["nodegroup-stacks"].endswith("AccessDenied")
    step = group_step(seen)
    assert step.observed.startswith("absent; stack unknown (cloudformation:DescribeStacks: AccessDenied)")
    assert commands(step) == [CREATE]


# --- planning -----------------------------------------------------------------------------------

def observed(stack: StackInfo | None) -> Observed:
    stacks = {} if stack is None else {"gpu-workers": stack}
    return Observed("ACTIVE", {"system-nodes": SYSTEM}, (), {}, True, frozenset(), frozenset(), daemonsets={},
                    tags={"trainlift.io/cluster": "ray-train"}, nodegroup_stacks=stacks)


def group_step(seen: Observed, placed: dict | None = None):
    plan = plan_up(SPEC, seen, PLACED if placed is None else placed, FILES)
    return next(s for s in plan.steps if s.key == "nodegroup/gpu-workers")


def commands(step) -> list[str]:
    return [op.text() for op in step.ops]


def test_the_recorded_rollback_complete_stack_is_deleted_before_the_create(stubbed):
    step = group_step(observed(recorded_stack(stubbed)))
    assert step.action == "create" and commands(step) == [DELETE, CREATE]
    assert step.observed.startswith(f"absent; stack {STACK} ROLLBACK_COMPLETE (left by a failed create)")
    assert step.note == "the stack is deleted first: eksctl skips a node group whose stack exists"


@pytest.mark.parametrize("status", ["CREATE_FAILED", "ROLLBACK_FAILED", "UPDATE_ROLLBACK_COMPLETE", "CREATE_COMPLETE"])
def test_any_other_settled_stack_of_an_absent_group_is_deleted_first(status):
    step = group_step(observed(StackInfo(STACK, status, {})))
    assert step.action == "create" and commands(step) == [DELETE, CREATE]
    assert f"stack {STACK} {status}" in step.observed


def test_a_stack_being_deleted_is_waited_for_then_the_group_created():
    step = group_step(observed(StackInfo(STACK, "DELETE_IN_PROGRESS", {})))
    assert step.action == "create"
    assert [op.until or op.argv[1] for op in step.ops] == ["nodegroup-stack/gpu-workers=absent", "create"]
    assert commands(step)[0] == (f"wait until nodegroup-stack/gpu-workers=absent  (like: aws cloudformation wait "
                                 f"stack-delete-complete --stack-name {STACK} --region us-east-2)")


@pytest.mark.parametrize("status", ["CREATE_IN_PROGRESS", "ROLLBACK_IN_PROGRESS", "UPDATE_IN_PROGRESS"])
def test_a_stack_eksctl_is_still_working_on_blocks(status):
    plan = plan_up(SPEC, observed(StackInfo(STACK, status, {})), PLACED, FILES)
    [blocked] = plan.blocked
    assert blocked.key == "nodegroup/gpu-workers" and blocked.ops == ()
    assert blocked.note == "eksctl is still working on this node group's stack; run up again once it has settled"


def test_a_stack_whose_delete_failed_blocks_with_the_cloudformation_delete():
    # eksctl lists no DELETE_FAILED node group stack, so neither its delete nor its create would clear it.
    step = group_step(observed(StackInfo(STACK, "DELETE_FAILED", {})))
    assert step.action == "blocked" and step.ops == ()
    assert step.fix == f"aws cloudformation delete-stack --stack-name {STACK} --region us-east-2  (then run up again)"


def test_no_stack_is_the_plain_create():
    step = group_step(observed(None))
    assert step.action == "create" and commands(step) == [CREATE]
    assert step.observed == "absent; AZ us-east-2a: pinned" and step.note == ""


def test_no_capacity_still_blocks_a_group_with_a_stack():
    placed = {"gpu-workers": Placement("gpu-workers", None, "", blocking="no AZ offers g6.12xlarge", fix="try x")}
    step = group_step(observed(StackInfo(STACK, "ROLLBACK_COMPLETE", {})), placed)
    assert step.action == "blocked" and step.note == "no AZ offers g6.12xlarge"
    assert f"stack {STACK} ROLLBACK_COMPLETE" in step.observed


# --- applying: the wait ------------------------------------------------------------------------

class _Deleting:
    def __init__(self, *answers):
        self.answers = list(answers)

    def nodegroup_stacks(self, cluster, groups):
        assert (cluster, list(groups)) == ("ray-train", ["gpu-workers"])
        return self.answers.pop(0)


def test_the_wait_holds_once_the_stack_is_gone():
    aws = _Deleting({"gpu-workers": StackInfo(STACK, "DELETE_IN_PROGRESS", {})}, Unknown("throttled"), {})
    until = "nodegroup-stack/gpu-workers=absent"
    assert apply_plan._satisfied(until, SPEC, FILES, aws) == (False, "DELETE_IN_PROGRESS")  # type: ignore[arg-type]
    assert apply_plan._satisfied(until, SPEC, FILES, aws) == (False, "throttled")  # type: ignore[arg-type]
    assert apply_plan._satisfied(until, SPEC, FILES, aws) == (True, "ABSENT")  # type: ignore[arg-type]


# --- the CLI ------------------------------------------------------------------------------------

def test_cluster_up_dry_run_shows_the_stack_and_both_commands(monkeypatch, tmp_path, stubbed):
    seen = replace(observed(recorded_stack(stubbed)), tools={t: True for t in ("eksctl", "helm", "kubectl", "aws")})
    files = Files(str(tmp_path), raycluster_hash="h1")
    prepared = lifecycle.Prepared(SPEC, seen, {}, PLACED, files, [], aws=None)  # type: ignore[arg-type]
    monkeypatch.setattr(lifecycle, "prepare", lambda *a, **k: prepared)
    result = CliRunner().invoke(app, ["cluster", "up", str(REFERENCE), "--dry-run", "--dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())  # the console wraps long lines
    assert f"observed: absent; stack {STACK} ROLLBACK_COMPLETE (left by a failed create)" in text
    delete = "$ eksctl delete nodegroup --cluster ray-train --region us-east-2 --name gpu-workers --wait"
    create = f"$ eksctl create nodegroup -f {tmp_path}/eksctl.yaml --include gpu-workers"
    assert delete in text and create in text and text.index(delete) < text.index(create)
    assert "the stack is deleted first: eksctl skips a node group whose stack exists" in text
