"""ClusterSpec -> the NetworkPolicy around the Ray pods: which ports others reach, and where the pods may go. Pure.

Selected: every Ray pod of the namespace (KubeRay labels each `ray.io/is-ray-node: "yes"`, common/pod.go labelPod
@v1.7.0), the standing RayCluster's and those a RayJob brings.

In (ingress):
- from the Ray pods of the namespace, on Ray's ports only (raycluster.py lists them: GCS, dashboard, client, the
  dashboard agent, its workers' range, and the kernel's ephemeral range, where Ray's other servers bind) and so on
  the job's own: torch's TCPStore and gloo's and NCCL's sockets bind ports from that ephemeral range too;
- from any pod of the namespace (a RayJob's submitter) and from the KubeRay operator's namespace on the dashboard
  port (8265) only: the submitter posts the job there, and the operator reads a RayJob's status from the head's Jobs
  API through the head Service (utils.FetchHeadServiceURL).

Out (egress), stated rather than left open:
- to the Ray pods of the namespace, on the same ports;
- to the cluster's DNS (CoreDNS, `k8s-app: kube-dns` in kube-system), port 53;
- to any address on HTTPS (443), the instance metadata service's link-local range excepted: S3, STS for the pods'
  role, the Hugging Face hub, package indexes;
- to the VPC's private ranges on any port: VPC endpoints and services of the VPC (an MLflow server there).
An MLflow server elsewhere must be served over HTTPS.

Not affected: `kubectl port-forward` (trainlift's way to the dashboard) enters the pod's own network namespace
through the API server and the kubelet, and traffic from the pod's node (the kubelet's probes) is always allowed
(Kubernetes "Network Policies"; the VPC CNI's policy agent allows the node's IP). EFA traffic is not IP, so no
NetworkPolicy applies to it. The VPC CNI enforces policies only with `enableNetworkPolicy` in its add-on
configuration, which render.eksctl sets (platform.yaml eks_addons); it supports port ranges (`endPort`).
"""

from __future__ import annotations

from typing import Any

from trainlift import catalog
from trainlift.config.cluster import ClusterSpec
from trainlift.render.raycluster import (AGENT_PORT, CLIENT_PORT, DASHBOARD_PORT, EPHEMERAL_PORTS, GCS_PORT,
                                         MANAGED_BY, WORKER_PORTS)

POLICY_NAME = "ray-same-namespace"
NETWORK_POLICY_PATH = "k8s/05-networkpolicy.yaml"
RAY_POD = {"ray.io/is-ray-node": "yes"}
NAMESPACE_LABEL = "kubernetes.io/metadata.name"  # set on every namespace by the API server (Kubernetes >= 1.22)
DNS = ({NAMESPACE_LABEL: "kube-system"}, {"k8s-app": "kube-dns"})
METADATA_RANGE = "169.254.0.0/16"  # the instance metadata service and other link-local endpoints
PRIVATE_RANGES = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")


def _tcp(port: int, end: int | None = None) -> dict[str, Any]:
    return {"protocol": "TCP", "port": port, **({"endPort": end} if end is not None else {})}


def ray_and_job_ports() -> list[dict[str, Any]]:
    """Ray's ports and the job's ephemeral range, as NetworkPolicy ports."""
    fixed = sorted({GCS_PORT, DASHBOARD_PORT, CLIENT_PORT, AGENT_PORT})
    return [*(_tcp(p) for p in fixed), _tcp(*WORKER_PORTS), _tcp(*EPHEMERAL_PORTS)]


def _egress() -> list[dict[str, Any]]:
    namespace, pods = DNS
    return [
        {"to": [{"podSelector": {"matchLabels": dict(RAY_POD)}}], "ports": ray_and_job_ports()},
        {"to": [{"namespaceSelector": {"matchLabels": namespace}, "podSelector": {"matchLabels": pods}}],
         "ports": [{"protocol": "UDP", "port": 53}, _tcp(53)]},
        {"to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": [METADATA_RANGE]}}], "ports": [_tcp(443)]},
        {"to": [{"ipBlock": {"cidr": cidr}} for cidr in PRIVATE_RANGES]},
    ]


def render_network_policy(spec: ClusterSpec) -> dict[str, Any]:
    operator = catalog.chart("kuberay-operator").namespace
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": POLICY_NAME, "namespace": spec.namespace, "labels": dict(MANAGED_BY)},
        "spec": {
            "podSelector": {"matchLabels": dict(RAY_POD)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": dict(RAY_POD)}}], "ports": ray_and_job_ports()},
                {"from": [{"podSelector": {}},
                          {"namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: operator}}}],
                 "ports": [_tcp(DASHBOARD_PORT)]},
            ],
            "egress": _egress(),
        },
    }
