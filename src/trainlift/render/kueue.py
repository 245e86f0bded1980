"""ClusterSpec -> Kueue objects: a ResourceFlavor per node group, one ClusterQueue, a LocalQueue, network Topologies.

Kueue admits a queued RayJob whole or not at all. Every pod of a RayJob is counted against the ClusterQueue, so
every node group its pods land on has a flavor: one per GPU worker group and one for the system group, where the
Ray head and the submitter run. A flavor's quota is its node group's total (count x the catalog's vCPUs, memory,
GPUs, and per node the EFA interfaces and hugepages one worker pod takes); a resource a pod requests that no
flavor covers would leave the job unadmittable.

Topology-aware placement: on instance types EKS labels with their place in the AWS network
(topology.k8s.aws/network-node-layer-1 at the top ... -3, or -4 on four-layer types; catalog `network_layers`),
a Topology lists those layers top down with kubernetes.io/hostname below them (Kueue's node level: it then assigns
pods to nodes and can replace a failed one), and the worker group asks to stay under one bottom-layer node.
"""

from __future__ import annotations

from typing import Any

from trainlift import catalog
from trainlift.config.cluster import ClusterSpec, WorkerGroup
from trainlift.render.eksctl import SYSTEM_LABELS, WORKER_GROUP_LABEL, WORKER_ROLE
from trainlift.render.problems import Problem
from trainlift.render.raycluster import (EFA_RESOURCE, EPHEMERAL_RESOURCE, GPU_RESOURCE, HUGEPAGES_RESOURCE, MANAGED_BY,
                                         ephemeral_gib, staging_gib)

API_VERSION = "kueue.x-k8s.io/v1beta2"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
NETWORK_LAYER_LABEL = "topology.k8s.aws/network-node-layer-{}"
HOSTNAME_LABEL = "kubernetes.io/hostname"
PODSET_TOPOLOGY = "kueue.x-k8s.io/podset-{}-topology"
# Kueue names the head's PodSet "head" (kueue pkg/controller/jobs/raycluster, headGroupPodSetName).
RESERVED_GROUP_NAME = "head"


def queue_name(spec: ClusterSpec) -> str:
    """The LocalQueue (in the jobs' namespace) and the ClusterQueue behind it."""
    return spec.name


def network_levels(layers: int) -> list[str]:
    """EKS's network-layer labels, top down, then the node."""
    return [NETWORK_LAYER_LABEL.format(i) for i in range(1, layers + 1)] + [HOSTNAME_LABEL]


def topology_name(spec: ClusterSpec, layers: int) -> str:
    return f"{spec.name}-network-{layers}-layers"


def podset_topology(spec: ClusterSpec, w: WorkerGroup) -> dict[str, str]:
    """The worker group's pod-template annotation: one bottom-layer network node; none without topology labels."""
    layers = w.profile.network_layers
    if spec.scheduler != "kueue" or not layers:
        return {}
    return {PODSET_TOPOLOGY.format(spec.placement): NETWORK_LAYER_LABEL.format(layers)}


def _meta(name: str, namespace: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if namespace:
        meta["namespace"] = namespace
    meta["labels"] = dict(MANAGED_BY)
    return meta


def render_topologies(spec: ClusterSpec) -> list[dict[str, Any]]:
    depths = sorted({w.profile.network_layers for w in spec.workers if w.profile.network_layers})
    return [{
        "apiVersion": API_VERSION,
        "kind": "Topology",
        "metadata": _meta(topology_name(spec, n)),
        "spec": {"levels": [{"nodeLabel": label} for label in network_levels(n)]},
    } for n in depths]


def flavor_name(spec: ClusterSpec, group: str) -> str:
    return f"{spec.name}-{group}"


def render_flavors(spec: ClusterSpec) -> list[dict[str, Any]]:
    """One per GPU worker group (its nodes by the labels eksctl gives them), then the system group's."""
    flavors = []
    for w in spec.workers:
        body: dict[str, Any] = {"nodeLabels": {"role": WORKER_ROLE, WORKER_GROUP_LABEL: w.name}}
        if w.profile.network_layers:
            body["topologyName"] = topology_name(spec, w.profile.network_layers)
        flavors.append({"apiVersion": API_VERSION, "kind": "ResourceFlavor",
                        "metadata": _meta(flavor_name(spec, w.name)), "spec": body})
    flavors.append({"apiVersion": API_VERSION, "kind": "ResourceFlavor", "metadata": _meta(flavor_name(spec, "system")),
                    "spec": {"nodeLabels": dict(SYSTEM_LABELS)}})
    return flavors


def covered_resources(spec: ClusterSpec) -> list[str]:
    """Every resource the pods request: Kueue does not admit a workload asking for one its queue does not cover."""
    extra = [EFA_RESOURCE, HUGEPAGES_RESOURCE] if spec.fabric == "efa" else []
    staging = [EPHEMERAL_RESOURCE] if any(staging_gib(w.profile) for w in spec.workers) else []
    return ["cpu", "memory", GPU_RESOURCE] + extra + staging


def group_totals(spec: ClusterSpec, w: WorkerGroup) -> dict[str, str]:
    """A worker group's quota: count x the catalog's figures per node (one Ray worker pod per node)."""
    p, n = w.profile, w.count
    totals = {"cpu": str(n * p.vcpus), "memory": f"{n * p.memory_mib}Mi", GPU_RESOURCE: str(n * p.gpus)}
    if spec.fabric == "efa":
        totals[EFA_RESOURCE] = str(n * p.efa_interfaces)
        totals[HUGEPAGES_RESOURCE] = f"{n * p.efa_hugepages_mib}Mi"
    if EPHEMERAL_RESOURCE in covered_resources(spec):
        totals[EPHEMERAL_RESOURCE] = f"{n * ephemeral_gib(p)}Gi"
    return totals


def system_totals(spec: ClusterSpec) -> dict[str, str]:
    p, n = catalog.lookup(spec.system.instance_type), spec.system.count
    zero = {r: "0" for r in covered_resources(spec)[2:]}
    return {"cpu": str(n * p.vcpus), "memory": f"{n * p.memory_mib}Mi", **zero}


def _flavor_quota(name: str, totals: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "resources": [{"name": r, "nominalQuota": q} for r, q in totals.items()]}


def render_cluster_queue(spec: ClusterSpec) -> dict[str, Any]:
    flavors = [_flavor_quota(flavor_name(spec, w.name), group_totals(spec, w)) for w in spec.workers]
    flavors.append(_flavor_quota(flavor_name(spec, "system"), system_totals(spec)))
    return {
        "apiVersion": API_VERSION,
        "kind": "ClusterQueue",
        "metadata": _meta(queue_name(spec)),
        "spec": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": spec.namespace}},
            "resourceGroups": [{"coveredResources": covered_resources(spec), "flavors": flavors}],
        },
    }


def render_local_queue(spec: ClusterSpec) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "LocalQueue",
        "metadata": _meta(queue_name(spec), spec.namespace),
        "spec": {"clusterQueue": queue_name(spec)},
    }


def render_kueue_objects(spec: ClusterSpec) -> list[dict[str, Any]]:
    """In apply order: what a later object names exists first."""
    return render_topologies(spec) + render_flavors(spec) + [render_cluster_queue(spec), render_local_queue(spec)]


def queue_problems(spec: ClusterSpec) -> list[Problem]:
    """Spec combinations the chosen scheduler would reject or ignore."""
    problems = []
    if spec.placement == "required" and spec.scheduler != "kueue":
        problems.append(Problem("placement", f"required needs scheduler: kueue (the spec says {spec.scheduler})",
                                "drop placement, or set scheduler: kueue"))
    if spec.scheduler == "kueue":
        for i, w in enumerate(spec.workers):
            if w.name == RESERVED_GROUP_NAME:
                problems.append(Problem(f"workers[{i}].name", "'head' is the Ray head's PodSet in Kueue, which "
                                        "rejects a worker group of that name", "rename the worker group"))
    return problems
