"""Scheduling on paper: does each rendered Ray pod fit a node of its group, after what EKS keeps for itself and
what lands there first (DaemonSets, add-ons, operators)? Allocatable is computed as EKS's AL2023 nodes compute it:
EC2 memory less the hypervisor's share, kube-reserved by max pods, the eviction threshold and huge pages
(catalog/scheduling.yaml names each figure's source). Pure: a cluster spec and a RayCluster dict in, numbers out.
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


@dataclass(frozen=True)
class Amount:
    cpu_m: int
    mem_mib: int

    def __add__(self, other: "Amount") -> "Amount":
        return Amount(self.cpu_m + other.cpu_m, self.mem_mib + other.mem_mib)

    def __sub__(self, other: "Amount") -> "Amount":
        return Amount(self.cpu_m - other.cpu_m, self.mem_mib - other.mem_mib)

    def text(self) -> str:
        return f"{self.cpu_m}m CPU, {self.mem_mib} MiB"


@lru_cache(maxsize=1)
def _data() -> dict[str, Any]:
    return load_data("scheduling.yaml")


def cpu_m(text: str | int | float) -> int:
    text = str(text)
    return int(text[:-1]) if text.endswith("m") else int(float(text) * 1000)


def mem_mib(text: str | int) -> int:
    match = re.fullmatch(r"([0-9.]+)(Ki|Mi|Gi|Ti)?", str(text))
    if not match:
        raise ValueError(f"not a memory quantity: {text}")
    scale = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "Ti": 1024 ** 2, None: 1 / 2 ** 20}[match.group(2)]
    return math.ceil(float(match.group(1)) * scale)


def kube_reserved_cpu_m(vcpus: int) -> float:
    reserved, left = 0.0, vcpus
    for cores, per_core in _data()["kube_reserved"]["cpu_tiers"]:
        n = left if cores is None else min(cores, left)
        reserved, left = reserved + n * per_core, left - n
    return reserved


def hugepages_mib(profile: catalog.InstanceProfile, efa: bool, pod_request_mib: int = 0) -> int:
    """2 MiB pages taken out of the node's memory: the pod's own request, or the EFA configuration's, the larger."""
    reserved = (_data()["efa_hugepage_mib_per_vcpu"] * profile.vcpus // 2 + 1) * 2 if efa else 0
    return max(reserved, pod_request_mib)


def allocatable(profile: catalog.InstanceProfile, hugepages: int = 0) -> Amount:
    data = _data()
    pods = data["max_pods"].get(profile.instance_type, data["max_pods_default"])
    reserved_mem = data["kube_reserved"]["memory_mib_per_pod"] * pods + data["kube_reserved"]["memory_mib_base"]
    memory = math.floor(profile.memory_mib * (1 - data["vm_memory_overhead"]))
    return Amount(profile.vcpus * 1000 - math.ceil(kube_reserved_cpu_m(profile.vcpus)),
                  memory - reserved_mem - data["eviction_memory_mib"] - hugepages)


def landed_first(spec: ClusterSpec, system: bool) -> dict[str, Amount]:
    """What is on a node before trainlift's Ray pod: DaemonSets, and on the system group the add-ons, operators and
    the RayJob's submitter (all counted on the head's node: where they land is the scheduler's choice)."""
    data = _data()
    entries = {**data["every_node"], **(data["system_node"] if system else {})}
    found = {}
    for name, e in entries.items():
        if e.get("when") not in (None, spec.scheduler):
            continue
        n = int(e.get("replicas", 1))
        found[name] = Amount(n * cpu_m(e.get("cpu", 0)), n * mem_mib(e.get("memory", 0)))
    return found


def room(spec: ClusterSpec, instance_type: str, system: bool, efa: bool = False, pod_hugepages_mib: int = 0) -> Amount:
    """What is left for the Ray pod on one node of this type."""
    profile = catalog.lookup(instance_type)
    first = sum(landed_first(spec, system).values(), Amount(0, 0))
    return allocatable(profile, hugepages_mib(profile, efa, pod_hugepages_mib)) - first


@dataclass(frozen=True)
class Placement:
    pod: str
    group: str
    instance_type: str
    need: Amount
    left: Amount  # for this pod on its node, after what landed first

    @property
    def fits(self) -> bool:
        return self.need.cpu_m <= self.left.cpu_m and self.need.mem_mib <= self.left.mem_mib

    def line(self) -> str:
        return (f"{self.pod} on {self.instance_type} ({self.group}): CPU {self.need.cpu_m}m of {self.left.cpu_m}m left, "
                f"memory {self.need.mem_mib} MiB of {self.left.mem_mib} MiB left")

    def to_dict(self) -> dict[str, Any]:
        return {"pod": self.pod, "group": self.group, "instance_type": self.instance_type, "fits": self.fits,
                "cpu_m": self.need.cpu_m, "cpu_m_left": self.left.cpu_m,
                "memory_mib": self.need.mem_mib, "memory_mib_left": self.left.mem_mib}


def _requests(group: dict[str, Any]) -> dict[str, str]:
    container = group["template"]["spec"]["containers"][0]
    return {k: str(v) for k, v in container.get("resources", {}).get("requests", {}).items()}


def placements(spec: ClusterSpec, raycluster_spec: dict[str, Any]) -> list[Placement]:
    head = _requests(raycluster_spec["headGroupSpec"])
    found = [Placement("ray-head", "system", spec.system.instance_type,
                       Amount(cpu_m(head.get("cpu", 0)), mem_mib(head.get("memory", 0))),
                       room(spec, spec.system.instance_type, system=True))]
    groups = {g["groupName"]: g for g in raycluster_spec.get("workerGroupSpecs", [])}
    for w in spec.workers:
        asked = _requests(groups[w.name])
        hugepages = mem_mib(asked.get(HUGEPAGES, 0))
        found.append(Placement(f"ray-worker ({w.name})", w.name, w.instance_type,
                               Amount(cpu_m(asked.get("cpu", 0)), mem_mib(asked.get("memory", 0))),
                               room(spec, w.instance_type, False, spec.fabric == "efa", hugepages)))
    return found


def fit_problems(found: list[Placement]) -> list[Problem]:
    problems = []
    for p in found:
        if p.fits:
            continue
        short = [what for what, need, left in (("CPU", p.need.cpu_m, p.left.cpu_m), ("memory", p.need.mem_mib,
                                                                                 p.left.mem_mib)) if need > left]
        problems.append(Problem(
            f"{p.group}", f"the {p.pod} pod does not fit a {p.instance_type} node ({' and '.join(short)}): "
            f"it requests {p.need.text()}, and {p.left.text()} is left after kube-reserved, eviction, huge pages "
            "and what lands there first",
            hint=f"choose a larger instance type for {p.group}, or lower what the pod requests"))
    return problems


def live_fit_problems(spec: ClusterSpec, found: list[Placement],
                      nodes: dict[str, list[tuple[str, Amount]]]) -> list[str]:
    """The same pods against the nodes' real `.status.allocatable` (group -> [(node, allocatable)]): each worker
    group needs a node per pod it places, the head one system node. A group with no nodes yet is not judged."""
    problems = []
    for p in found:
        mine = nodes.get(p.group, [])
        if not mine:
            continue
        first = sum(landed_first(spec, system=p.group == "system").values(), Amount(0, 0))
        rooms = [(name, alloc - first) for name, alloc in mine]
        fitting = [n for n, left in rooms if p.need.cpu_m <= left.cpu_m and p.need.mem_mib <= left.mem_mib]
        wanted = 1 if p.group == "system" else next(w.count for w in spec.workers if w.name == p.group)
        if len(fitting) < min(wanted, len(mine)):
            name, left = max(rooms, key=lambda r: (r[1].cpu_m, r[1].mem_mib))
            problems.append(f"the {p.pod} pod fits {len(fitting)} of {len(mine)} {p.instance_type} node(s) as they "
                            f"are: it requests {p.need.text()}; {name} has {left.text()} left of its allocatable "
                            "after what lands there first")
    return problems
