"""The cluster spec's `scheduler` -> what each renderer adds: queue labels, placement annotations, queue objects,
Helm values. `scheduler: none` adds nothing."""

from __future__ import annotations

from typing import Any

from trainlift.config.cluster import ClusterSpec
from trainlift.render import kueue, volcano


def queue_labels(spec: ClusterSpec) -> dict[str, str]:
    """The label that puts the standing RayCluster, or a RayJob that brings its own, in the cluster's queue."""
    if spec.scheduler == "kueue":
        return {kueue.QUEUE_LABEL: kueue.queue_name(spec)}
    if spec.scheduler == "volcano":
        return {volcano.QUEUE_LABEL: volcano.queue_name(spec)}
    return {}


def placement_annotations(spec: ClusterSpec):
    """A worker group -> its pod template's annotations (Kueue's topology request), for raycluster_spec."""
    return lambda w: kueue.podset_topology(spec, w)


def queue_objects(spec: ClusterSpec) -> list[dict[str, Any]]:
    """Cluster-wide objects applied after the scheduler's Helm release, before any queued workload."""
    if spec.scheduler == "kueue":
        return kueue.render_kueue_objects(spec)
    if spec.scheduler == "volcano":
        return [volcano.render_volcano_queue(spec)]
    return []


def queue_object_path(index: int, obj: dict[str, Any]) -> str:
    """k8s/15-<nn>-<kind>-<name>.yaml: after the namespace and service account, before the RayCluster."""
    return f"k8s/15-{index:02d}-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"


def kuberay_values(spec: ClusterSpec) -> dict[str, Any]:
    return dict(volcano.KUBERAY_VALUES) if spec.scheduler == "volcano" else {}
