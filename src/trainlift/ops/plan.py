"""Plan a cluster's lifecycle: (spec, observed state) -> ordered steps. Pure.

Every step carries what was observed, its action and the exact operations: commands
(eksctl, helm, kubectl, each idempotent) and waits (polls until a state holds).
`plan_up` goes from whatever exists to a healthy cluster, `plan_down` is its reverse.
A step that cannot proceed is `blocked` with the reason and the fix; apply refuses a
plan with a blocked step, so no money is spent on a cluster that cannot finish.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from trainlift.cloud.aws import NodeGroupInfo
from trainlift.config.cluster import ClusterSpec
from trainlift.ops import eksctl, kube
from trainlift.ops.kube import Node, RayState, Release
from trainlift.ops.placement import Placement
from trainlift.ops.run import display
from trainlift.render.eksctl import SYSTEM_GROUP, WORKER_GROUP_LABEL, WORKER_ROLE
from trainlift.render.helm import helm_install_args, render_helm_releases
from trainlift.render.raycluster import EFA_RESOURCE, GPU_RESOURCE

ABSENT = "ABSENT"
BUSY = ("CREATING", "PENDING", "UPDATING")
CLIENT_PORT = 10001


@dataclass(frozen=True)
class Observed:
    """What exists. None means unknown; `unknown` says why, by area (eks, kubernetes, helm)."""

    control_plane: str | None
    nodegroups: dict[str, NodeGroupInfo] | None = None
    nodes: tuple[Node, ...] | None = None
    releases: dict[str, Release] | None = None
    namespace: bool | None = None
    service_accounts: frozenset[str] | None = None
    secrets: frozenset[str] | None = None
    raycluster: RayState | None = None
    unknown: dict[str, str] = field(default_factory=dict)

    @classmethod
    def nothing(cls) -> "Observed":
        return cls(ABSENT, {}, (), {}, False, frozenset(), frozenset(), RayState(exists=False))

    @property
    def absent(self) -> bool:
        return self.control_plane == ABSENT

    def why(self, area: str) -> str:
        return f"unknown ({self.unknown.get(area, 'not observed')})"


@dataclass(frozen=True)
class Op:
    kind: str  # run | wait | doctor
    argv: tuple[str, ...] = ()
    until: str = ""  # for waits: what must hold, e.g. control-plane=ACTIVE, nodes/gpu-workers
    timeout_s: int = 1800
    background: tuple[str, ...] = ()  # for doctor: the port-forward it needs

    def text(self) -> str:
        if self.kind == "wait":
            return f"wait until {self.until}" + (f"  (like: {display(self.argv)})" if self.argv else "")
        if self.background:
            return f"{display(self.background)} &  {display(self.argv)}"
        return display(self.argv)


@dataclass(frozen=True)
class Step:
    key: str
    title: str
    observed: str
    action: str  # create | install | apply | wait | check | delete | nothing | blocked
    ops: tuple[Op, ...] = ()
    note: str = ""
    fix: str = ""


@dataclass(frozen=True)
class Files:
    """Where the rendered files of this cluster live (relative or absolute, as the user gave it)."""

    root: str
    raycluster_hash: str = ""
    service_account_file: bool = False

    def path(self, rel: str) -> str:
        return f"{self.root.rstrip('/')}/{rel}"

    @property
    def kubeconfig(self) -> str:
        return self.path("kubeconfig")


@dataclass(frozen=True)
class Plan:
    verb: str
    cluster: str
    region: str
    steps: tuple[Step, ...]

    @property
    def blocked(self) -> list[Step]:
        return [s for s in self.steps if s.action == "blocked"]

    @property
    def todo(self) -> list[Step]:
        return [s for s in self.steps if s.ops]

    def to_dict(self) -> dict[str, Any]:
        return {
            "verb": self.verb, "cluster": self.cluster, "region": self.region,
            "blocked": bool(self.blocked),
            "steps": [{**{k: v for k, v in asdict(s).items() if k != "ops"},
                       "commands": [op.text() for op in s.ops]} for s in self.steps],
        }


def _run(argv: list[str]) -> Op:
    return Op("run", tuple(argv))


def _wait(until: str, argv: list[str] | None = None, timeout_s: int = 1800) -> Op:
    return Op("wait", tuple(argv or ()), until, timeout_s)


def _aws_wait(what: str, spec: ClusterSpec, group: str | None = None) -> list[str]:
    argv = ["aws", "eks", "wait", what]
    argv += ["--cluster-name", spec.name, "--nodegroup-name", group] if group else ["--name", spec.name]
    return argv + ["--region", spec.region]


# --- up ------------------------------------------------------------------------------------------

def _control_plane_up(spec: ClusterSpec, seen: Observed, files: Files) -> Step:
    title = f"EKS control plane {spec.name} (Kubernetes {spec.kubernetes_version}, {spec.region})"
    status = seen.control_plane
    if status is None:
        return Step("control-plane", title, seen.why("eks"), "blocked",
                    note="cannot tell whether the control plane exists",
                    fix="allow eks:DescribeCluster for these credentials, or install eksctl")
    if status == ABSENT:
        return Step("control-plane", title, "absent", "create", (_run(eksctl.create_cluster(files.path("eksctl.yaml"))),))
    if status in BUSY:
        return Step("control-plane", title, status, "wait",
                    (_wait("control-plane=ACTIVE", _aws_wait("cluster-active", spec)),))
    if status == "ACTIVE":
        return Step("control-plane", title, "ACTIVE", "nothing")
    fix = display(eksctl.delete_cluster(spec.name, spec.region))
    note = ("being deleted; run up again once status shows it absent" if status == "DELETING"
            else f"{status}: delete it, then run up again")
    return Step("control-plane", title, status, "blocked", note=note, fix="" if status == "DELETING" else fix)


def _nodegroup_up(spec: ClusterSpec, seen: Observed, name: str, title: str, files: Files,
                  placement: Placement | None) -> Step:
    key = f"nodegroup/{name}"
    where = f"; AZ {placement.zone}: {placement.reason}" if placement and placement.zone else ""
    group = None if seen.nodegroups is None else seen.nodegroups.get(name)
    if group is None:
        observed = "absent" if seen.absent or seen.nodegroups is not None else (
            seen.why("eks") + "; eksctl skips a node group that exists")
        if placement is not None and placement.blocking:
            return Step(key, title, observed + where, "blocked", note=placement.blocking, fix=placement.fix)
        return Step(key, title, observed + where, "create",
                    (_run(eksctl.create_nodegroup(files.path("eksctl.yaml"), name)),))
    observed = f"{group.status}, {group.desired} nodes" + (f" in {', '.join(group.zones)}" if group.zones else "")
    if group.status == "ACTIVE":
        return Step(key, title, observed, "nothing")
    if group.status in BUSY:
        return Step(key, title, observed, "wait", (_wait(f"{key}=ACTIVE", _aws_wait("nodegroup-active", spec, name)),))
    if group.status == "DELETING":
        return Step(key, title, observed, "blocked", note="being deleted; run up again once it is gone")
    issues = "; ".join(group.issues) or "no health issues reported"
    return Step(key, title, observed, "blocked", note=f"{group.status}: {issues}",
                fix=display(eksctl.delete_nodegroup(spec.name, spec.region, name)) + "  (then run up again)")


def _worker_nodes(seen: Observed) -> list[Node]:
    return [n for n in seen.nodes or () if n.role == WORKER_ROLE]


def _plugin_up(spec: ClusterSpec, seen: Observed, files: Files, release: dict[str, Any],
               resource: str | None, wait: bool) -> Step:
    name, pinned = release["name"], release["version"]
    title = f"Helm release {name} {pinned} ({release['namespace']})"
    install = (_run(kube.helm_install(files.kubeconfig, helm_install_args(
        release, files.path(f"helm/{name}.values.yaml")), wait)),)
    if seen.absent:
        return Step(f"helm/{name}", title, "absent (new cluster)", "install", install)
    workers = _worker_nodes(seen)
    attr = {GPU_RESOURCE: "gpus", EFA_RESOURCE: "efa"}.get(resource or "")
    if attr and workers and all(getattr(n, attr) > 0 for n in workers):
        return Step(f"helm/{name}", title, f"{len(workers)} GPU nodes already advertise {resource}", "nothing",
                    note="skipped: the resource is already advertised")
    if seen.releases is None:
        return Step(f"helm/{name}", title, seen.why("helm"), "install", install)
    found = seen.releases.get(name)
    if found is None:
        return Step(f"helm/{name}", title, "not installed", "install", install)
    if found.status == "deployed" and found.version == pinned:
        return Step(f"helm/{name}", title, f"deployed ({found.version})", "nothing")
    return Step(f"helm/{name}", title, f"{found.status} ({found.version or found.chart}), pinned {pinned}",
                "install", install)


def _objects_up(spec: ClusterSpec, seen: Observed, files: Files) -> list[Step]:
    steps = []
    ns_title = f"namespace {spec.namespace}"
    if seen.namespace:
        steps.append(Step("namespace", ns_title, "exists", "nothing"))
    else:
        observed = "absent" if seen.absent or seen.namespace is False else seen.why("kubernetes")
        steps.append(Step("namespace", ns_title, observed, "apply",
                          (_run(kube.apply(files.kubeconfig, files.path("k8s/00-namespace.yaml"))),)))
    s3 = spec.storage.s3 if spec.storage else None
    if s3 is not None:
        title = f"service account {s3.service_account} (S3 checkpoints through IRSA)"
        if seen.service_accounts is not None and s3.service_account in seen.service_accounts:
            steps.append(Step("service-account", title, "exists", "nothing"))
        else:
            observed = "absent" if seen.service_accounts is not None or seen.absent else seen.why("kubernetes")
            argv = (kube.apply(files.kubeconfig, files.path("k8s/10-serviceaccount.yaml")) if s3.role_arn
                    else eksctl.create_service_accounts(files.path("eksctl.yaml")))
            steps.append(Step("service-account", title, observed, "apply" if s3.role_arn else "create", (_run(argv),)))
    for ref in spec.secrets:
        title = f"secret {ref.secret} (key {ref.key} -> {ref.env})"
        create = (f"kubectl --kubeconfig {files.kubeconfig} -n {spec.namespace} create secret generic "
                  f"{ref.secret} --from-literal={ref.key}=...")
        if seen.secrets is not None and ref.secret in seen.secrets:
            steps.append(Step(f"secret/{ref.secret}", title, "exists", "nothing"))
        elif seen.secrets is None and not seen.absent:
            steps.append(Step(f"secret/{ref.secret}", title, seen.why("kubernetes"), "nothing", fix=create))
        elif ref.optional:
            steps.append(Step(f"secret/{ref.secret}", title, "absent (optional: pods start without it)", "nothing",
                              fix=create))
        else:
            steps.append(Step(f"secret/{ref.secret}", title, "absent", "wait",
                              (_wait(f"secret/{ref.secret}", timeout_s=1800),),
                              note="trainlift never handles secret values: create it yourself", fix=create))
    return steps


def _raycluster_up(spec: ClusterSpec, seen: Observed, files: Files) -> Step:
    title = f"RayCluster {spec.namespace}/{spec.name} (server-side apply)"
    apply_op = (_run(kube.apply(files.kubeconfig, files.path("k8s/20-raycluster.yaml"))),)
    rc = seen.raycluster
    if seen.absent or (rc is not None and not rc.exists):
        return Step("raycluster", title, "absent", "apply", apply_op)
    if rc is None:
        return Step("raycluster", title, seen.why("kubernetes"), "apply", apply_op)
    if rc.spec_hash == files.raycluster_hash:
        return Step("raycluster", title, f"exists, spec unchanged (state {rc.state or 'unknown'})", "nothing")
    return Step("raycluster", title, "exists with a different spec", "apply", apply_op)


def _waits_up(spec: ClusterSpec, seen: Observed, files: Files) -> list[Step]:
    kc, ns, rc = files.kubeconfig, spec.namespace, seen.raycluster
    head_argv = kube.kubectl(kc, "-n", ns, "wait", "pod", "-l", kube.ray_selector(spec.name, "head"),
                             "--for=condition=Ready", "--timeout=600s")
    known = rc is not None and not seen.absent
    steps = [Step("wait/head", "Ray head pod Ready", "Ready" if known and rc.head_ready else "not Ready",
                  "nothing" if known and rc.head_ready else "wait",
                  () if known and rc.head_ready else (_wait("head-ready", head_argv, 900),))]
    expected = sum(w.count for w in spec.workers)
    running = rc.workers_running if known else 0
    worker_argv = kube.kubectl(kc, "-n", ns, "get", "pods", "-l", kube.ray_selector(spec.name, "worker"))
    steps.append(Step("wait/workers", f"{expected} Ray worker pods Running", f"{running} of {expected} Running",
                      "nothing" if running >= expected else "wait",
                      () if running >= expected else (_wait(f"workers-running={expected}", worker_argv, 1800),)))
    for w in spec.workers:
        gpus, efa = w.profile.gpus, (w.profile.efa_interfaces if spec.fabric == "efa" else 0)
        mine = [n for n in seen.nodes or () if n.group == w.name]
        good = [n for n in mine if n.ready and n.gpus >= gpus and n.efa >= efa]
        want = f"{gpus} {GPU_RESOURCE}" + (f" and {efa} {EFA_RESOURCE}" if efa else "")
        done = seen.nodes is not None and len(good) >= w.count
        argv = kube.kubectl(kc, "get", "nodes", "-l", f"{WORKER_GROUP_LABEL}={w.name}", "-o",
                            "custom-columns=NODE:.metadata.name,GPU:.status.allocatable.nvidia\\.com/gpu,"
                            "EFA:.status.allocatable.vpc\\.amazonaws\\.com/efa")
        observed = f"{len(good)} of {w.count} nodes advertise it" if seen.nodes is not None else (
            "no nodes yet" if seen.absent else seen.why("kubernetes"))
        steps.append(Step(f"wait/nodes/{w.name}", f"each {w.name} node advertises {want}", observed,
                          "nothing" if done else "wait", () if done else (_wait(f"nodes/{w.name}", argv, 1200),)))
    return steps


def doctor_op(spec: ClusterSpec, files: Files) -> Op:
    forward = kube.kubectl(files.kubeconfig, "-n", spec.namespace, "port-forward", f"svc/{spec.name}-head-svc",
                           f"{CLIENT_PORT}:{CLIENT_PORT}")
    doctor = ["trainlift", "doctor", "--address", f"ray://127.0.0.1:{CLIENT_PORT}", "--expect-fabric",
              spec.fabric or "any"]
    return Op("doctor", tuple(doctor), background=tuple(forward), timeout_s=600)


def plan_up(spec: ClusterSpec, seen: Observed, placements: dict[str, Placement], files: Files) -> Plan:
    steps = [_control_plane_up(spec, seen, files)]
    steps.append(_nodegroup_up(spec, seen, SYSTEM_GROUP,
                               f"node group {SYSTEM_GROUP} ({spec.system.count}x {spec.system.instance_type})",
                               files, None))
    for w in spec.workers:
        steps.append(_nodegroup_up(spec, seen, w.name, f"node group {w.name} ({w.count}x {w.instance_type})",
                                   files, placements.get(w.name)))
    releases = {r["name"]: r for r in render_helm_releases(spec)}
    steps.append(_plugin_up(spec, seen, files, releases["nvidia-device-plugin"], GPU_RESOURCE, wait=False))
    if "aws-efa-k8s-device-plugin" in releases:
        steps.append(_plugin_up(spec, seen, files, releases["aws-efa-k8s-device-plugin"], EFA_RESOURCE, wait=False))
    steps.append(_plugin_up(spec, seen, files, releases["kuberay-operator"], None, wait=True))
    steps += _objects_up(spec, seen, files)
    steps.append(_raycluster_up(spec, seen, files))
    steps += _waits_up(spec, seen, files)
    steps.append(Step("doctor", "trainlift doctor on every Ray node", "runs after every up", "check",
                      (doctor_op(spec, files),)))
    return Plan("up", spec.name, spec.region, tuple(steps))


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
        return Step(key, title, "DELETING", "wait", (_wait(f"{key}=absent", _aws_wait("nodegroup-deleted", spec, name)),))
    if group.status in BUSY:
        return Step(key, title, group.status, "delete", (_wait(f"{key}=settled"), delete))
    return Step(key, title, f"{group.status}, {group.desired} nodes", "delete", (delete,))


def plan_down(spec: ClusterSpec, seen: Observed, files: Files, keep_control_plane: bool = False) -> Plan:
    steps: list[Step] = []
    rc_title = f"RayCluster {spec.namespace}/{spec.name}"
    rc_delete = _run(kube.kubectl(files.kubeconfig, "-n", spec.namespace, "delete", "raycluster", spec.name,
                                  "--ignore-not-found", "--wait=true", "--timeout=10m"))
    if seen.absent or (seen.raycluster is not None and not seen.raycluster.exists):
        steps.append(Step("raycluster", rc_title, "absent", "nothing"))
    elif seen.control_plane is not None and seen.control_plane not in ("ACTIVE", "UPDATING"):
        steps.append(Step("raycluster", rc_title, f"no API server (control plane {seen.control_plane})", "nothing"))
    elif seen.raycluster is None and not keep_control_plane:
        steps.append(Step("raycluster", rc_title, seen.why("kubernetes"), "nothing",
                          note="deleting the control plane deletes it"))
    elif seen.raycluster is None:
        steps.append(Step("raycluster", rc_title, seen.why("kubernetes"), "delete", (rc_delete,)))
    else:
        steps.append(Step("raycluster", rc_title, f"exists (state {seen.raycluster.state or 'unknown'})", "delete",
                          (rc_delete,)))
    fate = "kept with the control plane" if keep_control_plane else "deleted with the control plane"
    steps.append(Step("add-ons", "Helm releases, namespace, service accounts, secrets",
                      "absent" if seen.absent else fate, "nothing"))
    for w in reversed(spec.workers):
        steps.append(_nodegroup_down(spec, seen, w.name, keep_control_plane))
    steps.append(_nodegroup_down(spec, seen, SYSTEM_GROUP, keep_control_plane))
    title = f"EKS control plane {spec.name} ({spec.region})"
    status = seen.control_plane
    delete = _run(eksctl.delete_cluster(spec.name, spec.region))
    if keep_control_plane:
        steps.append(Step("control-plane", title, status or seen.why("eks"), "nothing", note="kept (--keep-control-plane)"))
    elif status is None:
        steps.append(Step("control-plane", title, seen.why("eks"), "blocked", note="cannot tell whether it exists",
                          fix=display(eksctl.delete_cluster(spec.name, spec.region))))
    elif status == ABSENT:
        steps.append(Step("control-plane", title, "absent", "nothing"))
    elif status == "DELETING":
        steps.append(Step("control-plane", title, status, "wait",
                          (_wait("control-plane=absent", _aws_wait("cluster-deleted", spec)),)))
    elif status in BUSY:
        steps.append(Step("control-plane", title, status, "delete", (_wait("control-plane=settled"), delete)))
    else:
        steps.append(Step("control-plane", title, status, "delete", (delete,)))
    return Plan("down", spec.name, spec.region, tuple(steps))
