"""Apply a cluster plan: run each step's operations in order, wait for the states they need, and report what `up`
measured (the image pull time). Re-running the same command after any failure re-observes and continues."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable

from trainlift.cloud.aws import Aws
from trainlift.cloud.capacity import Unknown
from trainlift.config.cluster import ClusterSpec
from trainlift.errors import TrainliftError
from trainlift.ops import kube, plan_kube
from trainlift.ops.forward import wait_for_port
from trainlift.ops.lifecycle import Prepared, _write_kubeconfig
from trainlift.ops.plan import ABSENT, BUSY, Files, Op, Plan, Step
from trainlift.ops.run import Background, check
from trainlift.ops.steps import FORWARDED_DASHBOARD_PORT

POLL_S = 15.0
RUN_TIMEOUT_S = 3600


def image_pull_line(spec: ClusterSpec, files: Files) -> str:
    """How long each Ray pod's node took to pull the image, from kubelet's events (kept about an hour)."""
    pulls = kube.Kube(files.kubeconfig).image_pulls(spec.namespace)
    if isinstance(pulls, Unknown):
        return f"image pull time: unknown ({pulls.reason})"
    timed = sorted((p for p in pulls if p.seconds is not None), key=lambda p: -p.seconds)
    if not pulls:
        return "image pull time: no pull events (kubelet keeps them about an hour)"
    parts = [f"{int(p.seconds // 60)}m{p.seconds % 60:02.0f}s on {p.node or p.pod}" for p in timed]
    present = len(pulls) - len(timed)
    already = f"; already on {present} node(s)" if present else ""
    return f"image pull: {', '.join(parts) or 'none pulled'}{already} ({pulls[0].image}, from kubelet's events)"


def _group_status(aws: Aws, spec: ClusterSpec, name: str) -> str:
    if aws.cluster(spec.name) is None:
        return ABSENT
    group = aws.nodegroups(spec.name).get(name)
    return group.status if group else ABSENT


def _satisfied(until: str, spec: ClusterSpec, files: Files, aws: Aws) -> tuple[bool, str]:
    """(holds, what was seen) for one wait condition of the plan."""
    what, _, want = until.partition("=")
    if what == "stack":
        stack = aws.cluster_stack(spec.name)
        if isinstance(stack, Unknown):
            return False, stack.reason
        return stack is None, stack.status if stack else ABSENT
    if what.startswith("nodegroup-stack/"):
        group = what.split("/", 1)[1]
        stacks = aws.nodegroup_stacks(spec.name, [group])
        if isinstance(stacks, Unknown):
            return False, stacks.reason
        return group not in stacks, stacks[group].status if group in stacks else ABSENT
    if what == "control-plane":
        info = aws.cluster(spec.name)
        status = info.status if info else ABSENT
        if status == "FAILED" and want == "ACTIVE":
            raise TrainliftError(f"the control plane of {spec.name} is FAILED")
        return (status == want or (want == "absent" and status == ABSENT)
                or (want == "settled" and status not in BUSY)), status
    if what.startswith("nodegroup/"):
        status = _group_status(aws, spec, what.split("/", 1)[1])
        if status.endswith("FAILED") and want == "ACTIVE":
            raise TrainliftError(f"node group {what.split('/', 1)[1]} is {status}")
        return (status == want or (want == "absent" and status == ABSENT)
                or (want == "settled" and status not in BUSY)), status
    k = kube.Kube(files.kubeconfig)
    if what.startswith("secret/"):
        names = k.names("secrets", spec.namespace)
        return not isinstance(names, Unknown) and what.split("/", 1)[1] in names, "absent"
    if what in ("head-ready", "workers-running"):
        rc = k.raycluster(spec.namespace, spec.name)
        if isinstance(rc, Unknown):
            return False, rc.reason
        if what == "head-ready":
            return rc.head_ready, f"state {rc.state}"
        return rc.workers_running >= int(want), f"{rc.workers_running} Running"
    if what.startswith("nodes/"):
        name = what.split("/", 1)[1]
        w = next(w for w in spec.workers if w.name == name)
        efa = w.profile.efa_interfaces if spec.fabric == "efa" else 0
        nodes = k.nodes()
        if isinstance(nodes, Unknown):
            return False, nodes.reason
        good = [n for n in nodes if n.group == name and n.ready and n.gpus >= w.profile.gpus and n.efa >= efa]
        return len(good) >= w.count, f"{len(good)} of {w.count} nodes advertise GPUs" + (" and EFA" if efa else "")
    raise ValueError(f"unknown wait condition {until!r}")


def wait_for(op: Op, spec: ClusterSpec, files: Files, aws: Aws, poll_s: float = POLL_S,
             clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
    deadline = clock() + op.timeout_s
    while True:
        done, seen = _satisfied(op.until, spec, files, aws)
        if done:
            return
        if clock() >= deadline:
            raise TrainliftError(f"timed out after {op.timeout_s} s waiting until {op.until} (last seen: {seen})",
                                 hint="run the same command again to continue from here")
        sleep(poll_s)


def _doctor(op: Op, echo: Callable[[str], None], token: str | None) -> None:
    """`token`: the RayCluster's Ray token (its Secret), which the doctor's Jobs API client sends."""
    with Background(op.background) as forward:
        wait_for_port(forward, FORWARDED_DASHBOARD_PORT)
        check([sys.executable, "-m", "trainlift", *op.argv[1:]], op.timeout_s, attempts=1, echo=echo,
              env={"RAY_AUTH_TOKEN": token} if token else None)


def apply(prepared: Prepared, plan: Plan, echo: Callable[[str], None],
          on_step: Callable[[Step], None] = lambda s: None) -> list[str]:
    """Run every step's operations in order; stop at the first failure (re-running resumes)."""
    spec, files, aws = prepared.spec, prepared.files, prepared.aws
    if prepared.seen.assumed:
        raise TrainliftError(f"nothing is applied from a plan made without observing: {prepared.seen.assumed}")
    if plan.blocked:
        first = plan.blocked[0]
        raise TrainliftError(f"{first.title}: {first.note}", hint=first.fix or None)
    done = []
    for step in plan.steps:
        if not step.ops:
            continue
        on_step(step)
        if step.key != "control-plane" and not Path(files.kubeconfig).exists() and plan.verb == "up":
            info = aws.cluster(spec.name)
            if info is not None and info.endpoint and info.ca_data:
                _write_kubeconfig(spec, info, files)
        for op in step.ops:
            _apply_op(op, spec, files, aws, echo)
        done.append(step.key)
    return done


def _apply_op(op: Op, spec: ClusterSpec, files: Files, aws: Aws, echo: Callable[[str], None]) -> None:
    if op.kind == "wait":
        wait_for(op, spec, files, aws)
    elif op.kind == "doctor":
        from trainlift.ops.jobs import cluster_token
        from trainlift.render.raycluster import auth_secret_name

        _doctor(op, echo, cluster_token(files.kubeconfig, spec.namespace, auth_secret_name(spec)))
    elif op.kind == "tag":
        key, _, value = op.argv[1].partition("=")
        aws.tag_cluster(op.argv[0], {key: value})
    elif op.kind == "adopt":
        if _needs_adopting(op, files):
            check(list(op.argv), RUN_TIMEOUT_S, echo=echo)
    elif op.kind == "fit":
        nodes = kube.Kube(files.kubeconfig).nodes()
        problems = [] if isinstance(nodes, Unknown) else plan_kube.live_fit_problems(spec, nodes)
        if problems:
            raise TrainliftError("; ".join(problems), hint="choose a larger instance type, or lower the pod's "
                                 "requests; `kubectl describe node` shows allocatable and what runs there")
    elif op.kind == "crds":
        crds = check(list(op.argv), RUN_TIMEOUT_S, attempts=3)
        Path(op.until).parent.mkdir(parents=True, exist_ok=True)
        Path(op.until).write_text(crds.stdout)
        check(list(op.then), RUN_TIMEOUT_S, echo=echo, attempts=3)
    else:
        # eksctl creations are not safe to repeat blindly; the next `up` re-observes instead.
        attempts = 1 if op.argv[0] == "eksctl" else 3
        check(list(op.argv), RUN_TIMEOUT_S, echo=echo, attempts=attempts)


def _needs_adopting(op: Op, files: Files) -> bool:
    """At apply time: does the object exist without the Helm release's ownership marks?"""
    what, _, release = op.until.partition("=")
    _, namespace, name = what.split("/")
    owners = kube.Kube(files.kubeconfig).daemonsets(namespace)
    if isinstance(owners, Unknown):
        raise TrainliftError(f"cannot tell who owns daemonset {namespace}/{name}: {owners.reason}",
                             hint="run the same command again once kubectl reaches the cluster")
    return name in owners and owners[name] != release
