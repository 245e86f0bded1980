"""Kueue admission on paper: would Kueue ever admit each rendered workload it queues, given the ClusterQueue's quotas
and what already holds quota?

Kueue (v0.19) queues an object that carries `kueue.x-k8s.io/queue-name`: a RayCluster (head and one PodSet per
worker group; it holds its quota until deleted) or a RayJob that brings its own RayCluster (those PodSets plus the
submitter's in K8sJobMode). A RayJob with `clusterSelector` and no `rayClusterSpec` is not managed and takes no
quota. Each PodSet's requests (count x the containers' requests) go to the first ResourceFlavor whose node labels
agree with the pods' nodeSelector; a workload is admitted whole when, for every flavor and resource, what it needs
plus what earlier workloads hold is within the nominal quota. Pure: rendered manifest bodies in, numbers out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainlift.render.fit import cpu_m, mem_mib
from trainlift.render.kueue import QUEUE_LABEL
from trainlift.render.problems import Problem

Usage = dict[tuple[str, str], int]  # (flavor, resource) -> amount in the resource's unit (see `amount`)


def amount(resource: str, value: Any) -> int:
    """A quantity in one unit per resource: millicores for cpu, MiB for memory-like ones, a count otherwise."""
    if resource == "cpu":
        return cpu_m(value)
    if resource in ("memory", "ephemeral-storage") or resource.startswith("hugepages-"):
        return mem_mib(value)
    return int(value)


def show(resource: str, value: int) -> str:
    if resource == "cpu":
        return f"{value}m"
    if resource in ("memory", "ephemeral-storage") or resource.startswith("hugepages-"):
        return f"{value // 1024}Gi" if value % 1024 == 0 else f"{value}Mi"
    return str(value)


@dataclass(frozen=True)
class PodSet:
    name: str
    count: int
    requests: dict[str, int]
    node_selector: dict[str, str]


@dataclass
class Workload:
    path: str
    kind: str
    name: str
    podsets: list[PodSet]
    usage: Usage = field(default_factory=dict)  # filled in by `admit`

    @property
    def title(self) -> str:
        return f"{self.kind} {self.name}"


def _pod_requests(pod: dict[str, Any]) -> dict[str, int]:
    """Kueue's count for one pod: the containers' requests summed (a limit stands in for a missing request)."""
    total: dict[str, int] = {}
    for c in pod.get("containers", []):
        res = c.get("resources", {})
        asked = {**res.get("limits", {}), **res.get("requests", {})}
        for r, v in asked.items():
            total[r] = total.get(r, 0) + amount(r, v)
    return total


def _podset(name: str, count: int, template: dict[str, Any]) -> PodSet:
    pod = template.get("spec", {})
    return PodSet(name, count, _pod_requests(pod), dict(pod.get("nodeSelector", {})))


def raycluster_podsets(spec: dict[str, Any]) -> list[PodSet]:
    sets = [_podset("head", 1, spec["headGroupSpec"]["template"])]
    for g in spec.get("workerGroupSpecs", []):
        sets.append(_podset(g["groupName"], int(g.get("replicas", 0)) * int(g.get("numOfHosts", 1)), g["template"]))
    return sets


def queued_workloads(bodies: list[tuple[str, dict[str, Any]]]) -> list[Workload]:
    """(path, body) in apply order -> the workloads Kueue would queue, in the same order."""
    found = []
    for path, body in bodies:
        if not isinstance(body, dict) or QUEUE_LABEL not in body.get("metadata", {}).get("labels", {}):
            continue
        meta, spec = body["metadata"], body.get("spec", {})
        if body.get("kind") == "RayCluster":
            found.append(Workload(path, "RayCluster", meta["name"], raycluster_podsets(spec)))
        elif body.get("kind") == "RayJob" and spec.get("rayClusterSpec"):
            sets = raycluster_podsets(spec["rayClusterSpec"])
            if spec.get("submissionMode", "K8sJobMode") == "K8sJobMode" and spec.get("submitterPodTemplate"):
                sets.append(_podset("submitter", 1, spec["submitterPodTemplate"]))
            found.append(Workload(path, "RayJob", meta["name"], sets))
    return found


@dataclass(frozen=True)
class Queue:
    name: str
    covered: tuple[str, ...]
    flavors: tuple[tuple[str, dict[str, str], dict[str, int]], ...]  # (name, node labels, nominal quota)

    def quota(self) -> Usage:
        return {(name, r): q for name, _, quotas in self.flavors for r, q in quotas.items()}

    def flavor_for(self, ps: PodSet) -> str | None:
        """The first flavor whose node labels agree with the PodSet's nodeSelector (Kueue's flavor order)."""
        return next((name for name, labels, _ in self.flavors
                     if all(ps.node_selector.get(k, v) == v for k, v in labels.items())), None)


def cluster_queue(bodies: list[tuple[str, dict[str, Any]]]) -> Queue | None:
    labels = {b["metadata"]["name"]: b.get("spec", {}).get("nodeLabels", {})
              for _, b in bodies if isinstance(b, dict) and b.get("kind") == "ResourceFlavor"}
    cq = next((b for _, b in bodies if isinstance(b, dict) and b.get("kind") == "ClusterQueue"), None)
    if cq is None:
        return None
    covered: list[str] = []
    flavors = []
    for group in cq["spec"].get("resourceGroups", []):
        covered += group["coveredResources"]
        for f in group["flavors"]:
            quota = {r["name"]: amount(r["name"], r["nominalQuota"]) for r in f["resources"]}
            flavors.append((f["name"], labels.get(f["name"], {}), quota))
    return Queue(cq["metadata"]["name"], tuple(covered), tuple(flavors))


def admit(queue: Queue, workloads: list[Workload]) -> list[Problem]:
    """Admit the workloads in order, each holding its quota for the ones after it (filling in `usage`); a problem
    per workload Kueue would never admit: a resource the queue does not cover, no flavor for a PodSet, too little
    quota."""
    held: Usage = {}
    holders: dict[tuple[str, str], list[str]] = {}
    quota = queue.quota()
    problems = []
    for w in workloads:
        never = f"Kueue would never admit {w.title}"
        uncovered = sorted({r for ps in w.podsets for r in ps.requests if r not in queue.covered})
        if uncovered:
            problems.append(Problem(w.path, f"{never}: it requests {', '.join(uncovered)}, which ClusterQueue "
                                    f"{queue.name} does not cover",
                                    hint="add the resource to the ClusterQueue's coveredResources"))
            continue
        need: Usage = {}
        unplaced = [ps for ps in w.podsets if queue.flavor_for(ps) is None]
        if unplaced:
            problems.append(Problem(w.path, f"{never}: no ResourceFlavor of ClusterQueue {queue.name} matches "
                                    f"PodSet {unplaced[0].name}'s nodeSelector {unplaced[0].node_selector}",
                                    hint="give the PodSet a node group's labels"))
            continue
        for ps in w.podsets:
            flavor = queue.flavor_for(ps)
            for r, v in ps.requests.items():
                need[(flavor, r)] = need.get((flavor, r), 0) + ps.count * v
        short = sorted(((key, v) for key, v in need.items() if held.get(key, 0) + v > quota.get(key, 0)),
                       key=lambda kv: kv[0][1] in ("cpu", "memory"))  # an accelerator first, where one is short
        if short:
            problems.append(_short_problem(w, queue, short[0], quota, held, holders))
            continue
        w.usage = need
        for key, v in need.items():
            held[key] = held.get(key, 0) + v
            holders.setdefault(key, []).append(w.title)
    return problems


def _short_problem(w: Workload, queue: Queue, short: tuple[tuple[str, str], int], quota: Usage, held: Usage,
                   holders: dict[tuple[str, str], list[str]]) -> Problem:
    (flavor, resource), need = short
    q, taken = quota.get((flavor, resource), 0), held.get((flavor, resource), 0)
    text = (f"Kueue would never admit {w.title}: it needs {resource} {show(resource, need)} in flavor {flavor}, "
            f"whose quota in ClusterQueue {queue.name} is {show(resource, q)}")
    if taken and need <= q:
        text += f", and {' and '.join(holders[(flavor, resource)])} holds {show(resource, taken)} of it while it exists"
        hint = ("run the job on the standing RayCluster: without --job-shutdown the RayJob uses clusterSelector "
                "and takes no quota")
    else:
        hint = "ask for fewer workers, or add nodes to the worker group the quota comes from"
    return Problem(w.path, text, hint=hint)


def unqueued_lines(bodies: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """A RayJob that runs on a standing RayCluster: outside the queue, which admitted that cluster."""
    return [f"RayJob {b['metadata']['name']} runs on RayCluster {b['spec']['clusterSelector'].get('ray.io/cluster')} "
            "(clusterSelector): Kueue does not queue it, and it takes no quota"
            for _, b in bodies if isinstance(b, dict) and b.get("kind") == "RayJob"
            and b.get("spec", {}).get("clusterSelector") and not b["spec"].get("rayClusterSpec")]


def admission_lines(queue: Queue, workloads: list[Workload]) -> list[str]:
    """One line per admitted workload: what it takes of each flavor's quota (GPUs, EFA and CPU first)."""
    quota = queue.quota()
    lines = []
    for w in workloads:
        by_flavor: dict[str, list[str]] = {}
        for (flavor, r), v in w.usage.items():
            if v:
                by_flavor.setdefault(flavor, []).append(f"{r} {show(r, v)} of {show(r, quota[(flavor, r)])}")
        if by_flavor:
            parts = "; ".join(f"{f}: {', '.join(used)}" for f, used in by_flavor.items())
            lines.append(f"{w.title} admitted in ClusterQueue {queue.name}: {parts}")
    return lines
