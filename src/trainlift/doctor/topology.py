"""How far apart in the network a job's nodes are: the EKS network topology labels of the nodes its pods run on.

Pure: Kubernetes `Node` and `Pod` objects (as `kubectl get -o json` prints them) in, a count out.
"""

from __future__ import annotations

from typing import Any

# EKS user guide, "Place distributed AI/ML workloads with network topology labels": layer 3 is the bottom layer
# for most instance types (layer 4 exists on four-layer types); nodes sharing it are the closest.
LAYER3 = "topology.k8s.aws/network-node-layer-3"


def pod_node_names(pods: list[dict[str, Any]]) -> set[str]:
    """The nodes a job's pods are bound to (a pending pod has none yet)."""
    return {name for pod in pods if (name := (pod.get("spec") or {}).get("nodeName"))}


def layer3_span(nodes: list[dict[str, Any]], names: set[str] | None = None) -> dict[str, Any]:
    """Distinct layer-3 network nodes among `nodes` (those named in `names`, when given), and the nodes that
    carry no such label (instance types without network topology)."""
    chosen = [n for n in nodes if names is None or (n.get("metadata") or {}).get("name") in names]
    values, unlabelled = set(), []
    for node in chosen:
        meta = node.get("metadata") or {}
        value = (meta.get("labels") or {}).get(LAYER3)
        if value:
            values.add(value)
        else:
            unlabelled.append(meta.get("name", ""))
    return {"nodes": len(chosen), "layer3": sorted(values), "unlabelled": sorted(unlabelled)}


def layer3_line(span: dict[str, Any]) -> str:
    count = len(span["layer3"])
    line = f"{span['nodes']} node(s) span {count} layer-3 network node(s)"
    if span["unlabelled"]:
        line += f"; {len(span['unlabelled'])} without {LAYER3}: {', '.join(span['unlabelled'])}"
    return line
