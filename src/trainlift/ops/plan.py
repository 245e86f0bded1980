"""Plan a cluster's lifecycle: (spec, observed state) -> ordered steps. Pure.

Every step carries what was observed, its action and the exact operations: commands
(eksctl, helm, kubectl, each idempotent) and waits (polls until a state holds).
`plan_up` goes from whatever exists to a healthy cluster, `plan_down` is its reverse.
A step that cannot proceed is `blocked` with the reason and the fix; apply refuses a
plan with a blocked step, so no money is spent on a cluster that cannot finish.
The EKS steps are here; the Kubernetes steps in plan_kube.py, the checks that come
first (tools, ownership) in preflight.py, node group drift in drift.py.
"""

from __future__ import annotations

from dataclasses import replace

from trainlift.cloud.ecr import ABSENT_HINT
from trainlift.cloud.eks_state import NodeGroupInfo, StackInfo
from trainlift.config.cluster import ClusterSpec
from trainlift.ops import eksctl, kube, plan_kube
from trainlift.ops.drift import GroupWant, cluster_settings_step, nodegroup_drift
from trainlift.ops.placement import Placement
from trainlift.ops.pins import pins_step
from trainlift.ops.preflight import ownership_step, tools_needed, tools_step
from trainlift.ops.run import display
from trainlift.ops.steps import ABSENT, BUSY, Files, Observed, Op, Plan, Step, aws_wait, waiting_for_block
from trainlift.ops.steps import run_op as _run
from trainlift.ops.steps import wait_op as _wait
from trainlift.render.eksctl import SYSTEM_GROUP, head_zones
from trainlift.render.helm import render_helm_releases
from trainlift.render.image_cache import CACHE_PREFIX, UPSTREAM, create_rule_argv

__all__ = ["ABSENT", "BUSY", "Files", "Observed", "Op", "Plan", "Step", "plan_down", "plan_up"]
doctor_op = plan_kube.doctor_op


# --- up ------------------------------------------------------------------------------------------

def _stack_text(stack: StackInfo) -> str:
    return f"stack {stack.name} {stack.status}"


def _control_plane_absent(spec: ClusterSpec, seen: Observed, files: Files, title: str) -> Step:
    """No EKS cluster: create it, after deleting what a failed `eksctl create cluster` left behind."""
    create = _run(eksctl.create_cluster(files.path("eksctl.yaml")))
    stack = seen.stack
    if stack is None:
        observed = "absent" + (f"; stack unknown ({seen.unknown['stack']})" if "stack" in seen.unknown else "")
        return Step("control-plane", title, observed, "create", (create,))
    observed = f"absent; {_stack_text(stack)}"
    if stack.status == "DELETE_IN_PROGRESS":
        return Step("control-plane", title, observed, "create", (_wait("stack=absent"), create))
    if stack.status.endswith("_IN_PROGRESS"):
        return Step("control-plane", title, observed, "blocked",
                    note="eksctl is still working on this cluster's stack; run up again once it has settled")
    return Step("control-plane", title, observed + " (left by a failed create)", "create",
                (_run(eksctl.delete_cluster(spec.name, spec.region)), create),
                note="the stack is deleted first: `eksctl create cluster` refuses a stack that exists")


def _control_plane_up(spec: ClusterSpec, seen: Observed, files: Files) -> Step:
    title = f"EKS control plane {spec.name} (Kubernetes {spec.kubernetes_version}, {spec.region})"
    status = seen.control_plane
    if status is None:
        return Step("control-plane", title, seen.why("eks"), "blocked",
                    note="cannot tell whether the control plane exists",
                    fix="allow eks:DescribeCluster for these credentials, or install eksctl")
    if status == ABSENT:
        return _control_plane_absent(spec, seen, files, title)
    if status in BUSY:
        return Step("control-plane", title, status, "wait",
                    (_wait("control-plane=ACTIVE", aws_wait("cluster-active", spec)),))
    if status == "ACTIVE":
        return Step("control-plane", title, "ACTIVE", "nothing")
    fix = display(eksctl.delete_cluster(spec.name, spec.region))
    note = ("being deleted; run up again once status shows it absent" if status == "DELETING"
            else f"{status}: delete it, then run up again")
    return Step("control-plane", title, status, "blocked", note=note, fix="" if status == "DELETING" else fix)


def _group_exists(spec: ClusterSpec, want: GroupWant, group: NodeGroupInfo, title: str) -> Step:
    key = f"nodegroup/{want.name}"
    observed = f"{group.status}, {group.desired} nodes" + (f" in {', '.join(group.zones)}" if group.zones else "")
    delete = display(eksctl.delete_nodegroup(spec.name, spec.region, want.name)) + "  (then run up again)"
    if group.status == "ACTIVE":
        drift = nodegroup_drift(want, group)
        if drift.replace:
            return Step(key, title, observed, "blocked", fix=delete,
                        note=f"changed in the spec: {'; '.join(drift.replace)}: only a new node group can have it")
        if drift.resize is not None:
            return Step(key, title, f"{observed}; the spec says {drift.resize}", "apply",
                        (_run(eksctl.scale_nodegroup(spec.name, spec.region, want.name, drift.resize)),),
                        note=f"scaled in place to {drift.resize} nodes")
        return Step(key, title, observed, "nothing")
    if group.status in BUSY:
        return Step(key, title, observed, "wait", (_wait(f"{key}=ACTIVE", aws_wait("nodegroup-active", spec, want.name)),))
    if group.status == "DELETING":
        return Step(key, title, observed, "blocked", note="being deleted; run up again once it is gone")
    issues = "; ".join(group.issues) or "no health issues reported"
    return Step(key, title, observed, "blocked", note=f"{group.status}: {issues}", fix=delete)


def _nodegroup_up(spec: ClusterSpec, seen: Observed, want: GroupWant, files: Files,
                  placement: Placement | None) -> Step:
    key, title = f"nodegroup/{want.name}", f"node group {want.name} ({want.count}x {want.instance_type})"
    where = f"; AZ {placement.zone}: {placement.reason}" if placement and placement.zone else ""
    group = None if seen.nodegroups is None else seen.nodegroups.get(want.name)
    if group is not None:
        return _group_exists(spec, want, group, title)
    stack = seen.nodegroup_stacks.get(want.name)
    if stack is not None:
        first = _group_stack_first(spec, want.name, stack, key, title)
    else:
        observed = "absent" if seen.absent or seen.nodegroups is not None else (
            seen.why("eks") + "; eksctl skips a node group that exists")
        if seen.nodegroups is not None and "nodegroup-stacks" in seen.unknown:
            observed += f"; stack unknown ({seen.unknown['nodegroup-stacks']})"
        first = Step(key, title, observed, "create")
    if first.action == "blocked":
        return replace(first, observed=first.observed + where)
    if placement is not None and placement.blocking:
        return Step(key, title, first.observed + where, "blocked", note=placement.blocking, fix=placement.fix)
    create = _run(eksctl.create_nodegroup(files.path("eksctl.yaml"), want.name))
    return replace(first, observed=first.observed + where, ops=first.ops + (create,))


def _group_stack_first(spec: ClusterSpec, name: str, stack: StackInfo, key: str, title: str) -> Step:
    """A node group EKS does not list, with a stack: what must happen to the stack before the create, since
    `eksctl create nodegroup` skips a group whose stack exists."""
    observed = f"absent; {_stack_text(stack)}"
    if stack.status == "DELETE_IN_PROGRESS":
        return Step(key, title, observed, "create", (_wait(f"nodegroup-stack/{name}=absent", [
            "aws", "cloudformation", "wait", "stack-delete-complete", "--stack-name", stack.name,
            "--region", spec.region]),))
    if stack.status.endswith("_IN_PROGRESS"):
        return Step(key, title, observed, "blocked",
                    note="eksctl is still working on this node group's stack; run up again once it has settled")
    if stack.status == "DELETE_FAILED":
        # eksctl lists no DELETE_FAILED node group stack: its delete goes to EKS (no such group) and its create
        # to CloudFormation (the name is taken); pkg/cfn/manager/nodegroup.go, ListNodeGroupStacks (v0.230.0).
        return Step(key, title, observed, "blocked",
                    note="the stack's delete failed, and eksctl neither deletes nor replaces such a stack: delete "
                         "it once the resource its events name is free",
                    fix=display(["aws", "cloudformation", "delete-stack", "--stack-name", stack.name,
                                 "--region", spec.region]) + "  (then run up again)")
    return Step(key, title, observed + " (left by a failed create)", "create",
                (_run(eksctl.delete_nodegroup(spec.name, spec.region, name)),),
                note="the stack is deleted first: eksctl skips a node group whose stack exists")


def image_step(spec: ClusterSpec, seen: Observed) -> Step:
    """The image every Ray pod pulls, asked of its registry before anything bills: a tag (or digest) it does not have
    blocks `up` in one line that names the tags it does have."""
    title, found = "container image", seen.image
    if found is None:
        return Step("image", title, seen.why("image"), "nothing",
                    note="not confirmed in its registry: the pods pull it as written")
    if found.found:
        return Step("image", title, f"{found.image} exists" + (f" ({found.digest})" if found.digest else ""),
                    "nothing")
    return Step("image", title, "absent", "blocked", note=found.absent_line(), fix=ABSENT_HINT)


def _image_cache_up(spec: ClusterSpec, seen: Observed) -> list[Step]:
    """`image.cache: ecr`: the region's pull-through cache rule, before any node pulls the image through it. It
    serves every cluster of the account and region, so `down` leaves it."""
    if spec.image.cache != "ecr":
        return []
    title = f"ECR pull-through cache {CACHE_PREFIX}/ <- {UPSTREAM} ({spec.region})"
    create = (_run(create_rule_argv(spec.region)),)
    if seen.absent and seen.cache_rule is None and "image-cache" not in seen.unknown:
        return [Step("image-cache", title, "absent", "create", create)]
    if seen.cache_rule is None:
        return [Step("image-cache", title, seen.why("image-cache"), "blocked",
                     note="cannot tell whether the rule exists; creating one that does fails",
                     fix="allow ecr:DescribePullThroughCacheRules for these credentials")]
    if seen.cache_rule == "":
        return [Step("image-cache", title, "absent", "create", create)]
    if seen.cache_rule != UPSTREAM:
        return [Step("image-cache", title, f"exists for {seen.cache_rule}", "blocked",
                     note=f"the {CACHE_PREFIX}/ prefix caches another registry",
                     fix="drop image.cache, or delete that rule: aws ecr delete-pull-through-cache-rule "
                         f"--ecr-repository-prefix {CACHE_PREFIX} --region {spec.region}")]
    return [Step("image-cache", title, "exists", "nothing")]


def _wants(spec: ClusterSpec, seen: Observed) -> list[GroupWant]:
    """Each group as it should be now: a group on a Capacity Block not yet active keeps 0 nodes (a launch before
    the block starts fails); the `up` after its start scales it to its count."""
    system = GroupWant(SYSTEM_GROUP, spec.system.instance_type, spec.system.count, tuple(head_zones(spec)))
    return [system] + [GroupWant(w.name, w.instance_type, w.count if waiting_for_block(w, seen) is None else 0,
                                 tuple(w.availability_zones)) for w in spec.workers]



def _assumed(steps: list[Step], seen: Observed) -> list[Step]:
    if not seen.assumed:
        return steps
    looked_up_anyway = ("tools", "pins", "ownership")
    return [replace(s, observed=f"not looked up, planned as {s.observed}") if s.key not in looked_up_anyway
            else s for s in steps]


def plan_up(spec: ClusterSpec, seen: Observed, placements: dict[str, Placement], files: Files,
            force: bool = False) -> Plan:
    steps = [ownership_step(spec, seen, "up", force), image_step(spec, seen), _control_plane_up(spec, seen, files),
             cluster_settings_step(spec, seen, files)]
    steps += plan_kube.namespace_and_secrets(spec, seen, files)
    steps += _image_cache_up(spec, seen)
    groups = [_nodegroup_up(spec, seen, want, files, placements.get(want.name)) for want in _wants(spec, seen)]
    steps += groups
    releases = {r["name"]: r for r in render_helm_releases(spec)}
    steps.append(plan_kube.nvidia_up(seen, files, releases["nvidia-device-plugin"]))
    if "aws-efa-k8s-device-plugin" in releases:
        creates = any(s.action == "create" for s in groups[1:])
        steps.append(plan_kube.efa_up(seen, files, releases["aws-efa-k8s-device-plugin"], creates))
    if "volcano" in releases:
        steps.append(plan_kube.release_up(seen, files, releases["volcano"]))
    steps.append(plan_kube.release_up(seen, files, releases["kuberay-operator"]))
    if "kueue" in releases:
        steps.append(plan_kube.release_up(seen, files, releases["kueue"]))
    steps += plan_kube.queues_up(spec, seen, files)
    steps += plan_kube.service_account_up(spec, seen, files)
    steps.append(plan_kube.raycluster_up(spec, seen, files))
    steps += plan_kube.waits_up(spec, seen, files, replaced=steps[-1].action == "replace")
    steps.append(Step("doctor", "trainlift doctor on every Ray node", "runs after every up", "check",
                      (plan_kube.doctor_op(spec, files),)))
    steps.insert(0, pins_step(spec, seen, list(releases.values()), tools_needed(steps)))
    steps.insert(0, tools_step(steps, seen))
    return Plan("up", spec.name, spec.region, tuple(_assumed(steps, seen)))


# --- down ----------------------------------------------------------------------------------------

def _nodegroup_down(spec: ClusterSpec, seen: Observed, name: str, keep: bool) -> Step:
    key, title = f"nodegroup/{name}", f"node group {name}"
    if seen.absent:
        return Step(key, title, "absent", "nothing")
    if seen.nodegroups is None:
        if keep:
            return Step(key, title, seen.why("eks"), "blocked", note="cannot tell whether it exists",
                        fix=display(eksctl.delete_nodegroup(spec.name, spec.region, name)))
        return Step(key, title, seen.why("eks"), "nothing", note="deleting the control plane deletes it")
    group = seen.nodegroups.get(name)
    if group is None:
        return Step(key, title, "absent", "nothing")
    delete = _run(eksctl.delete_nodegroup(spec.name, spec.region, name))
    if group.status == "DELETING":
        return Step(key, title, "DELETING", "wait", (_wait(f"{key}=absent", aws_wait("nodegroup-deleted", spec, name)),))
    if group.status in BUSY:
        return Step(key, title, group.status, "delete", (_wait(f"{key}=settled"), delete))
    return Step(key, title, f"{group.status}, {group.desired} nodes", "delete", (delete,))


def _raycluster_down(spec: ClusterSpec, seen: Observed, files: Files, keep_control_plane: bool) -> Step:
    title = f"RayCluster {spec.namespace}/{spec.name}"
    delete = _run(kube.kubectl(files.kubeconfig, "-n", spec.namespace, "delete", "raycluster", spec.name,
                               "--ignore-not-found", "--wait=true", "--timeout=10m"))
    if seen.absent or (seen.raycluster is not None and not seen.raycluster.exists):
        return Step("raycluster", title, "absent", "nothing")
    if seen.control_plane is not None and seen.control_plane not in ("ACTIVE", "UPDATING"):
        return Step("raycluster", title, f"no API server (control plane {seen.control_plane})", "nothing")
    if seen.raycluster is None and not keep_control_plane:
        return Step("raycluster", title, seen.why("kubernetes"), "nothing", note="deleting the control plane deletes it")
    if seen.raycluster is None:
        return Step("raycluster", title, seen.why("kubernetes"), "delete", (delete,))
    return Step("raycluster", title, f"exists (state {seen.raycluster.state or 'unknown'})", "delete", (delete,))


def _control_plane_down(spec: ClusterSpec, seen: Observed, keep_control_plane: bool) -> Step:
    title = f"EKS control plane {spec.name} ({spec.region})"
    status = seen.control_plane
    delete = _run(eksctl.delete_cluster(spec.name, spec.region))
    if keep_control_plane:
        return Step("control-plane", title, status or seen.why("eks"), "nothing", note="kept (--keep-control-plane)")
    if status is None:
        return Step("control-plane", title, seen.why("eks"), "blocked", note="cannot tell whether it exists",
                    fix=display(eksctl.delete_cluster(spec.name, spec.region)))
    if status == ABSENT and seen.stack is not None:
        observed = f"absent; {_stack_text(seen.stack)}"
        if seen.stack.status == "DELETE_IN_PROGRESS":
            return Step("control-plane", title, observed, "wait", (_wait("stack=absent"),))
        return Step("control-plane", title, observed + " (left by a failed create)", "delete", (delete,),
                    note="eksctl deletes the stack of a cluster that was never created")
    if status == ABSENT:
        return Step("control-plane", title, "absent", "nothing")
    if status == "DELETING":
        return Step("control-plane", title, status, "wait",
                    (_wait("control-plane=absent", aws_wait("cluster-deleted", spec)),))
    if status in BUSY:
        return Step("control-plane", title, status, "delete", (_wait("control-plane=settled"), delete))
    return Step("control-plane", title, status, "delete", (delete,))


def plan_down(spec: ClusterSpec, seen: Observed, files: Files, keep_control_plane: bool = False,
              force: bool = False) -> Plan:
    steps = [ownership_step(spec, seen, "down", force), _raycluster_down(spec, seen, files, keep_control_plane)]
    fate = "kept with the control plane" if keep_control_plane else "deleted with the control plane"
    steps.append(Step("add-ons", "Helm releases, namespace, service accounts, secrets",
                      "absent" if seen.absent else fate, "nothing"))
    for w in reversed(spec.workers):
        steps.append(_nodegroup_down(spec, seen, w.name, keep_control_plane))
    steps.append(_nodegroup_down(spec, seen, SYSTEM_GROUP, keep_control_plane))
    steps.append(_control_plane_down(spec, seen, keep_control_plane))
    steps.insert(0, tools_step(steps, seen))
    return Plan("down", spec.name, spec.region, tuple(_assumed(steps, seen)))
