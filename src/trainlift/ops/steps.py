"""The plan's vocabulary: what was observed, the steps, their operations, where the files are. Pure."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from trainlift.cloud.eks_state import NodeGroupInfo, StackInfo
from trainlift.cloud.capacity import Reservation
from trainlift.cloud.ecr import ImageLookup
from trainlift.config.cluster import ClusterSpec
from trainlift.ops.kube import Node, RayState, Release
from trainlift.ops.run import display
from trainlift.render.eksctl import block_active

ABSENT = "ABSENT"
BUSY = ("CREATING", "PENDING", "UPDATING")
DASHBOARD_PORT = 8265  # the head's dashboard and Jobs API
FORWARDED_DASHBOARD_PORT = 18265  # where `cluster up` forwards it: 8265 may be `trainlift local up`'s


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
    tools: dict[str, bool] | None = None  # tool -> found on PATH
    tool_versions: dict[str, str | None] | None = None  # tool -> the x.y.z it reports (None: could not tell)
    charts: dict[str, str] | None = None  # Helm release -> "" when its pinned chart version exists, else Helm's error
    chart_digests: dict[str, str] = field(default_factory=dict)  # Helm release -> sha256 of the archive pulled
    # Helm release -> (the digest its archive must have, where that pin comes from); (None, "") when none yet
    chart_pins: dict[str, tuple[str | None, str]] = field(default_factory=dict)
    cache_rule: str | None = None  # the ECR pull-through cache rule's upstream ("": none; None: not looked up)
    image: ImageLookup | None = None  # what the image's registry said (None: not asked, or unknown: see `unknown`)
    tags: dict[str, str] | None = None  # the cluster's tags, or its stack's when only the stack exists
    cluster_arn: str = ""
    api_cidrs: tuple[str, ...] | None = None  # the control plane's publicAccessCidrs (None: no control plane seen)
    cni_network_policy: bool | None = None  # the vpc-cni add-on enforces NetworkPolicy (None: unknown, see `unknown`)
    stack: StackInfo | None = None  # eksctl's control plane stack; None: none (or unknown, see `unknown`)
    # eksctl's stack of each node group EKS does not list; a group without one is left out (unknown: see `unknown`)
    nodegroup_stacks: dict[str, StackInfo] = field(default_factory=dict)
    daemonsets: dict[str, str] | None = None  # kube-system DaemonSet -> the Helm release owning it, or ""
    assumed: str = ""  # why nothing was looked up (a dry run without credentials plans as if nothing exists)
    reservations: dict = field(default_factory=dict)  # capacity reservation id -> Reservation or Unknown (EC2's)
    unknown: dict[str, str] = field(default_factory=dict)

    @classmethod
    def nothing(cls, assumed: str = "") -> "Observed":
        return cls(ABSENT, {}, (), {}, False, frozenset(), frozenset(), RayState(exists=False), daemonsets={},
                   assumed=assumed)

    @property
    def absent(self) -> bool:
        return self.control_plane == ABSENT

    def why(self, area: str) -> str:
        return f"unknown ({self.unknown.get(area, 'not observed')})"


@dataclass(frozen=True)
class Op:
    kind: str  # run | wait | doctor | adopt (run argv only if `until` holds at apply time) | tag (arn, key=value)
    # | crds (argv's output written to the file `until`, then `then` applies that file) | fit (render's scheduling
    # check on the joined nodes' allocatable)
    argv: tuple[str, ...] = ()
    until: str = ""  # for waits: what must hold, e.g. control-plane=ACTIVE; for adopt: kind/namespace/name=release
    timeout_s: int = 1800
    background: tuple[str, ...] = ()  # for doctor: the port-forward it needs
    then: tuple[str, ...] = ()  # for crds

    def text(self) -> str:
        if self.kind == "wait":
            return f"wait until {self.until}" + (f"  (like: {display(self.argv)})" if self.argv else "")
        if self.kind == "adopt":
            what, _, release = self.until.partition("=")
            return f"if {what} exists and Helm release {release} does not own it: {display(self.argv)}"
        if self.kind == "tag":
            return f"aws eks tag-resource --resource-arn {self.argv[0]} --tags {self.argv[1]}"
        if self.kind == "fit":
            return f"check that {self.until}"
        if self.kind == "crds":
            return f"{display(self.argv)} > {self.until} && {display(self.then)}"
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
    scheduling: tuple[str, ...] = ()  # render's placements and Kueue admissions, a line each

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


def run_op(argv: list[str]) -> Op:
    return Op("run", tuple(argv))


def wait_op(until: str, argv: list[str] | None = None, timeout_s: int = 1800) -> Op:
    return Op("wait", tuple(argv or ()), until, timeout_s)


def aws_wait(what: str, spec: ClusterSpec, group: str | None = None) -> list[str]:
    argv = ["aws", "eks", "wait", what]
    argv += ["--cluster-name", spec.name, "--nodegroup-name", group] if group else ["--name", spec.name]
    return argv + ["--region", spec.region]


def waiting_for_block(w, seen: Observed) -> str | None:
    """Why worker group `w` stays at 0 nodes for now: its Capacity Block is not known to be active (a launch before
    its start fails). None when the group is not on a block or the block is active."""
    if not w.capacity_block or block_active(w, seen.reservations):
        return None
    found = seen.reservations.get(w.capacity_reservation_id)
    if isinstance(found, Reservation):
        state = found.state + (f", starts {found.start}" if found.start else "")
    else:
        state = "not known to be active"
    return (f"Capacity Block {w.capacity_reservation_id} is {state}: 0 nodes until it is active; "
            "run `cluster up` again once it is")
