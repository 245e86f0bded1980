"""Scheduling on paper: does each rendered Ray pod fit a node of its group, after what EKS keeps for itself and
what lands there first (DaemonSets, add-ons, operators)? Allocatable is computed as EKS's AL2023 nodes compute it:
EC2 memory less the hypervisor's share, kube-reserved by max pods, the eviction thresholds and the huge page pool
EFA's configuration pre-allocates; ephemeral storage from the disk under the kubelet (catalog/scheduling.yaml names
each figure's source). The system node keeps room for a DaemonSet more than the spec's features bring; a system type
too small for that and the smallest Ray head gives way to the next size of its family (`with_system_headroom`).
Pure: a cluster spec and a RayCluster dict in, numbers out.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from trainlift import catalog
from trainlift.catalog.lookup import load_data
from trainlift.config.cluster import ClusterSpec
from trainlift.render.problems import Problem

HUGEPAGES = "hugepages-2Mi"
EPHEMERAL = "ephemeral-storage"
SYSTEM = "system"
# (label, Amount field, unit) of each resource a pod requests and a node reports.
RESOURCES = (("CPU", "cpu_m", "m"), ("memory", "mem_mib", " MiB"), (HUGEPAGES, "hugepages_mib", " MiB"),
             (EPHEMERAL, "ephemeral_mib", " MiB"))


@dataclass(frozen=True)
class Amount:
    cpu_m: int
    mem_mib: int
    hugepages_mib: int = 0
    ephemeral_mib: int = 0

    def __add__(self, other: "Amount") -> "Amount":
        return Amount(*(getattr(self, f) + getattr(other, f) for _, f, _ in RESOURCES))

    def __sub__(self, other: "Amount") -> "Amount":
        return Amount(*(getattr(self, f) - getattr(other, f) for _, f, _ in RESOURCES))

    def short_of(self, left: "Amount") -> list[str]:
        """The resources this (a pod's request) needs more of than `left` has."""
        return [label for label, f, _ in RESOURCES if getattr(self, f) > getattr(left, f)]

    def text(self, like: "Amount | None" = None) -> str:
        """CPU and memory, and huge pages and ephemeral storage where `like` (default: this) has any."""
        like = like or self
        extra = [f"{label} {getattr(self, f)} MiB" for label, f, _ in RESOURCES[2:] if getattr(like, f)]
        return ", ".join([f"{self.cpu_m}m CPU", f"{self.mem_mib} MiB", *extra])

    def value(self, label: str) -> int:
        return next(getattr(self, f) for name, f, _ in RESOURCES if name == label)


def quantity(label: str, value: int) -> str:
    return next(f"{value}{unit}".strip() for name, _, unit in RESOURCES if name == label)


@lru_cache(maxsize=1)
def _data() -> dict[str, Any]:
    return load_data("scheduling.yaml")


def cpu_m(text: str | int | float) -> int:
    text = str(text)
    return int(text[:-1]) if text.endswith("m") else int(float(text) * 1000)


def mem_mib(text: str | int) -> int:
    match = re.fullmatch(r"([0-9.]+)(Ki|Mi|Gi|Ti|k|M|G|T)?", str(text))
    if not match:
        raise ValueError(f"not a memory quantity: {text}")
    scale = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "Ti": 1024 ** 2, None: 1 / 2 ** 20,
             "k": 1e3 / 2 ** 20, "M": 1e6 / 2 ** 20, "G": 1e9 / 2 ** 20, "T": 1e12 / 2 ** 20}[match.group(2)]
    return math.ceil(float(match.group(1)) * scale)


def kube_reserved_cpu_m(vcpus: int) -> float:
    reserved, left = 0.0, vcpus
    for cores, per_core in _data()["kube_reserved"]["cpu_tiers"]:
        n = left if cores is None else min(cores, left)
        reserved, left = reserved + n * per_core, left - n
    return reserved


def hugepage_pool_mib(profile: catalog.InstanceProfile, efa: bool) -> int:
    """The 2 MiB pages efa-config pre-allocates at boot on a node with an EFA interface attached (55 x vCPUs + 1
    pages; catalog/scheduling.yaml efa-hugepages), taken out of the node's memory; none without EFA."""
    if not (efa and profile.efa_supported):
        return 0
    return (_data()["efa_hugepage_mib_per_vcpu"] * profile.vcpus // 2 + 1) * 2


def allocatable(profile: catalog.InstanceProfile, hugepages: int = 0, disk_mib: int = 0) -> Amount:
    """What the kubelet of an EKS AL2023 node of this type reports as `.status.allocatable`: capacity less
    kube-reserved, the hard eviction thresholds and (memory) the huge page pool; ephemeral storage from the
    filesystem under the kubelet's directory, `disk_mib` (0: not judged)."""
    data = _data()
    reserved = data["kube_reserved"]
    memory = math.floor(profile.memory_mib * (1 - data["vm_memory_overhead"]))
    ephemeral = max(0, disk_mib - reserved["ephemeral_mib"] - math.ceil(disk_mib * data["eviction_nodefs_share"]))
    return Amount(profile.vcpus * 1000 - math.ceil(kube_reserved_cpu_m(profile.vcpus)),
                  memory - (reserved["memory_mib_per_pod"] * profile.max_pods + reserved["memory_mib_base"])
                  - data["eviction_memory_mib"] - hugepages, hugepages, ephemeral if disk_mib else 0)


def disk_mib(spec: ClusterSpec, group: str) -> int:
    """The filesystem the kubelet's directory sits on: a worker's instance-store NVMe, RAID0 (render/eksctl.py), or
    its group's root volume."""
    if group == SYSTEM:
        return spec.system.volume_size_gb * 1024
    w = next(w for w in spec.workers if w.name == group)
    if w.profile.local_nvme_gb:
        return math.floor(w.profile.local_nvme_gb * 1e9 / 2 ** 20)
    return w.volume_size_gb * 1024


def node_allocatable(spec: ClusterSpec, group: str, instance_type: str | None = None) -> Amount:
    """What render expects a node of the group (the system group: "system") to report as allocatable."""
    if group == SYSTEM:
        profile = catalog.lookup(instance_type or spec.system.instance_type)
        return allocatable(profile, 0, disk_mib(spec, group))
    w = next(w for w in spec.workers if w.name == group)
    profile = catalog.lookup(instance_type or w.instance_type)
    return allocatable(profile, hugepage_pool_mib(profile, spec.fabric == "efa"), disk_mib(spec, group))


def features(spec: ClusterSpec) -> set[str]:
    """What the spec turns on that brings pods of its own to the nodes (catalog/scheduling.yaml `when`)."""
    found = {spec.scheduler}
    if spec.storage and spec.storage.fsx:
        found.add("fsx")
    if spec.fabric == "efa":
        found.add("efa")
    return found


def landed_first(spec: ClusterSpec, system: bool) -> dict[str, Amount]:
    """What is on a node before trainlift's Ray pod: DaemonSets (the device plugins on GPU workers), a margin for one
    DaemonSet more, and on the system group the add-ons, operators and the RayJob's submitter (all counted on the
    head's node: where they land is the scheduler's choice)."""
    data = _data()
    entries = {**data["every_node"], **data["system_node" if system else "worker_node"]}
    on = features(spec)
    found = {}
    for name, e in entries.items():
        if e.get("when") not in (None, *on):
            continue
        n = int(e.get("replicas", 1))
        found[name] = Amount(n * cpu_m(e.get("cpu", 0)), n * mem_mib(e.get("memory", 0)))
    return found


def _first(spec: ClusterSpec, system: bool) -> Amount:
    return sum(landed_first(spec, system).values(), Amount(0, 0))


def room(spec: ClusterSpec, instance_type: str, system: bool, efa: bool = False, pod_hugepages_mib: int = 0) -> Amount:
    """CPU and memory left for the Ray pod on one node of this type, after the huge page pool EFA pre-allocates
    (`efa`) and what lands there first. (`pod_hugepages_mib` is not needed: the pool does not grow for a pod.)"""
    profile = catalog.lookup(instance_type)
    left = allocatable(profile, hugepage_pool_mib(profile, efa)) - _first(spec, system)
    return Amount(left.cpu_m, left.mem_mib)


def node_room(spec: ClusterSpec, group: str, instance_type: str | None = None) -> Amount:
    """Every resource left for the Ray pod on one node of the group, after what lands there first."""
    return node_allocatable(spec, group, instance_type) - _first(spec, group == SYSTEM)


@dataclass(frozen=True)
class Placement:
    pod: str
    group: str
    instance_type: str
    need: Amount
    left: Amount  # for this pod on its node, after what landed first

    @property
    def fits(self) -> bool:
        return not self.need.short_of(self.left)

    def line(self) -> str:
        extra = "".join(f", {label} {self.need.value(label)} of {self.left.value(label)} MiB left"
                        for label, f, _ in RESOURCES[2:] if getattr(self.need, f))
        return (f"{self.pod} on {self.instance_type} ({self.group}): CPU {self.need.cpu_m}m of {self.left.cpu_m}m left, "
                f"memory {self.need.mem_mib} MiB of {self.left.mem_mib} MiB left{extra}")

    def to_dict(self) -> dict[str, Any]:
        return {"pod": self.pod, "group": self.group, "instance_type": self.instance_type, "fits": self.fits,
                "cpu_m": self.need.cpu_m, "cpu_m_left": self.left.cpu_m,
                "memory_mib": self.need.mem_mib, "memory_mib_left": self.left.mem_mib,
                "hugepages_mib": self.need.hugepages_mib, "hugepages_mib_left": self.left.hugepages_mib,
                "ephemeral_mib": self.need.ephemeral_mib, "ephemeral_mib_left": self.left.ephemeral_mib}


def _requests(group: dict[str, Any]) -> Amount:
    container = group["template"]["spec"]["containers"][0]
    asked = {k: str(v) for k, v in container.get("resources", {}).get("requests", {}).items()}
    return Amount(cpu_m(asked.get("cpu", 0)), mem_mib(asked.get("memory", 0)), mem_mib(asked.get(HUGEPAGES, 0)),
                  mem_mib(asked.get(EPHEMERAL, 0)))


def placements(spec: ClusterSpec, raycluster_spec: dict[str, Any]) -> list[Placement]:
    found = [Placement("ray-head", SYSTEM, spec.system.instance_type, _requests(raycluster_spec["headGroupSpec"]),
                       node_room(spec, SYSTEM))]
    groups = {g["groupName"]: g for g in raycluster_spec.get("workerGroupSpecs", [])}
    for w in spec.workers:
        found.append(Placement(f"ray-worker ({w.name})", w.name, w.instance_type, _requests(groups[w.name]),
                               node_room(spec, w.name)))
    return found


def fit_problems(found: list[Placement]) -> list[Problem]:
    problems = []
    for p in found:
        if p.fits:
            continue
        problems.append(Problem(
            f"{p.group}", f"the {p.pod} pod does not fit a {p.instance_type} node ({' and '.join(p.need.short_of(p.left))}): "
            f"it requests {p.need.text()}, and {p.left.text(like=p.need)} is left after kube-reserved, eviction, huge "
            "pages and what lands there first",
            hint=f"choose a larger instance type for {p.group}, or lower what the pod requests"))
    return problems


def live_fit_problems(spec: ClusterSpec, found: list[Placement],
                      nodes: dict[str, list[tuple[str, Amount]]]) -> list[str]:
    """The same pods against the nodes' real `.status.allocatable` (group -> [(node, allocatable)]): each worker
    group needs a node per pod it places, the head one system node. A group with no nodes yet is not judged. Each
    node the pod does not fit gets a finding: the node, the resource, what render expected the node to have and what
    it reports."""
    problems = []
    for p in found:
        mine = nodes.get(p.group, [])
        if not mine:
            continue
        first = _first(spec, system=p.group == SYSTEM)
        expected = node_allocatable(spec, p.group)
        short = {name: p.need.short_of(alloc - first) for name, alloc in mine}
        wanted = 1 if p.group == SYSTEM else next(w.count for w in spec.workers if w.name == p.group)
        fitting = [name for name, lacks in short.items() if not lacks]
        if len(fitting) >= min(wanted, len(mine)):
            continue
        lines = []
        for name, alloc in mine:
            for label in short[name]:
                lines.append(f"node {name} {label}: allocatable {quantity(label, alloc.value(label))}, render expected "
                             f"{quantity(label, expected.value(label))}; the pod requests "
                             f"{quantity(label, p.need.value(label))} and "
                             f"{quantity(label, (alloc - first).value(label))} is left after what lands there first")
        problems.append(f"the {p.pod} pod fits {len(fitting)} of {len(mine)} {p.instance_type} node(s) as they are: "
                        + "; ".join(lines))
    return problems


@dataclass(frozen=True)
class SystemSize:
    instance_type: str
    note: str  # why another type than the spec's, and what it costs; "" when the spec's type has room


def system_size(spec: ClusterSpec) -> SystemSize:
    """The system node type the spec's DaemonSets, add-ons, operators, submitter, the margin for one more DaemonSet
    and the smallest Ray head fit on: the spec's own, or else the next size of its family (with why, and the price
    per hour against the spec's). A family with no larger type keeps the spec's, and render refuses it with the
    numbers."""
    from trainlift.render.raycluster import HEAD_FLOOR  # the smallest Ray head render sizes

    floor = Amount(HEAD_FLOOR[0], HEAD_FLOOR[1] * 1024)
    chosen = spec.system.instance_type
    left = node_room(spec, SYSTEM, chosen)
    if not floor.short_of(left):
        return SystemSize(chosen, "")
    family, vcpus = chosen.split(".")[0], catalog.lookup(chosen).vcpus
    larger = sorted((catalog.lookup(t).vcpus, t) for t in catalog.instance_types(gpu=False)
                    if t.split(".")[0] == family and catalog.lookup(t).vcpus > vcpus)
    fitting = [t for _, t in larger if not floor.short_of(node_room(spec, SYSTEM, t))]
    if not fitting:
        return SystemSize(chosen, "")
    picked = fitting[0]
    return SystemSize(picked, f"system node {chosen} leaves {left.text(like=floor)} for the Ray head after its DaemonSets, "
                      f"add-ons and a margin for one more DaemonSet; the head needs at least {floor.text()}: "
                      f"rendered {picked} instead ({_price_change(chosen, picked, spec.region, spec.system.count)})")


def _price_change(old: str, new: str, region: str, count: int) -> str:
    was, now = catalog.on_demand_price(old, region), catalog.on_demand_price(new, region)
    if was is None or now is None:
        missing = old if was is None else new
        return f"trainlift's catalog has no {region} price for {missing}: `trainlift price {new} --live` asks AWS"
    more = (now.usd_per_hour - was.usd_per_hour) * count
    return (f"${now.usd_per_hour:.4f}/h a node against ${was.usd_per_hour:.4f}/h on demand in {region}: "
            f"+${more:.4f}/h for {count} node(s)")


def with_system_headroom(spec: ClusterSpec) -> tuple[ClusterSpec, str]:
    """The spec with its system node type sized by `system_size`, and the note that says why (or "")."""
    size = system_size(spec)
    if size.instance_type == spec.system.instance_type:
        return spec, ""
    system = spec.system.model_copy(update={"instance_type": size.instance_type})
    return spec.model_copy(update={"system": system}), size.note
