"""ClusterSpec -> the NetworkPolicy that keeps the Ray pods' ports to their own namespace. Pure.

Selected: every Ray pod of the namespace (KubeRay labels each `ray.io/is-ray-node: "yes"`, common/pod.go labelPod
@v1.7.0), the standing RayCluster's and those a RayJob brings. Admitted:

- any pod of the same namespace, on any port: workers reach the head's GCS (6379) and, for object transfers and
  calls to the driver and Ray Train's controller that run on the head, its raylet, object manager, dashboard agent,
  runtime-env agent and worker ports, which Ray picks at random or from 10002-19999 (Ray docs, "Configuring Ports");
  the head reaches the workers the same way, and the RayJob submitter the head's Jobs API (8265);
- the KubeRay operator's namespace on the dashboard port (8265) only: the operator reads a RayJob's status from the
  head's Jobs API through the head Service (utils.FetchHeadServiceURL).

Not affected: `kubectl port-forward` (trainlift's way to the dashboard) enters the pod's own network namespace
through the API server and the kubelet, and traffic from the pod's node (the kubelet's probes) is always allowed
(Kubernetes "Network Policies"; the VPC CNI's policy agent allows the node's IP). The VPC CNI enforces policies only
with `enableNetworkPolicy` in its add-on configuration, which render.eksctl sets (platform.yaml eks_addons).
"""

from __future__ import annotations

from typing import Any

from trainlift import catalog
from trainlift.config.cluster import ClusterSpec
from trainlift.render.raycluster import MANAGED_BY

POLICY_NAME = "ray-same-namespace"
NETWORK_POLICY_PATH = "k8s/05-networkpolicy.yaml"
RAY_POD = {"ray.io/is-ray-node": "yes"}
NAMESPACE_LABEL = "kubernetes.io/metadata.name"  # set on every namespace by the API server (Kubernetes >= 1.22)
DASHBOARD_PORT = 8265


def render_network_policy(spec: ClusterSpec) -> dict[str, Any]:
    operator = catalog.chart("kuberay-operator").namespace
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": POLICY_NAME, "namespace": spec.namespace, "labels": dict(MANAGED_BY)},
        "spec": {
            "podSelector": {"matchLabels": dict(RAY_POD)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {}}]},
                {"from": [{"namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: operator}}}],
                 "ports": [{"protocol": "TCP", "port": DASHBOARD_PORT}]},
            ],
        },
    }
