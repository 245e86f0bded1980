"""ClusterSpec -> Volcano: a Queue whose capability is the cluster's node groups, the label that puts a RayJob in it,
and the KubeRay Helm value that makes Volcano KubeRay's batch scheduler (gang scheduling through a PodGroup).

KubeRay creates the PodGroup from the RayCluster: minMember is the desired worker replicas plus one for the head,
and only the RayCluster's pods get the group annotation, so the submitter pod of a K8sJobMode RayJob is not a member
and is not counted (kuberay, ray-operator/controllers/ray/batchscheduler/volcano/volcano_scheduler.go:
DoBatchSchedulingOnSubmission and AddMetadataToPod).
"""

from __future__ import annotations

from typing import Any

from trainlift.config.cluster import ClusterSpec
from trainlift.render.kueue import group_totals, system_totals
from trainlift.render.raycluster import MANAGED_BY

API_VERSION = "scheduling.volcano.sh/v1beta1"
QUEUE_LABEL = "volcano.sh/queue-name"
KUBERAY_VALUES = {"batchScheduler": {"name": "volcano"}}


def queue_name(spec: ClusterSpec) -> str:
    return spec.name


def capability(spec: ClusterSpec) -> dict[str, str]:
    """Every node group's total, as in the Kueue quotas (amounts in Mi or plain counts)."""
    parts = [group_totals(spec, w) for w in spec.workers] + [system_totals(spec)]
    out: dict[str, str] = {}
    for name, first in parts[0].items():
        unit = next((u for u in ("Mi", "Gi") if first.endswith(u)), "")
        amount = sum(int(p.get(name, "0").removesuffix(unit)) for p in parts)
        out[name] = f"{amount}{unit}"
    return out


def render_volcano_queue(spec: ClusterSpec) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "Queue",
        "metadata": {"name": queue_name(spec), "labels": dict(MANAGED_BY)},
        "spec": {"weight": 1, "reclaimable": False, "capability": capability(spec)},
    }
