"""ClusterSpec -> Helm releases: NVIDIA device plugin, AWS EFA device plugin, KubeRay operator, and the scheduler
(Kueue or Volcano) the spec names."""

from __future__ import annotations

from typing import Any

import yaml

from trainlift import catalog
from trainlift.catalog.lookup import load_data
from trainlift.config.cluster import ClusterSpec
from trainlift.render.eksctl import SYSTEM_LABELS, WORKER_ROLE
from trainlift.render.queues import kuberay_values
from trainlift.render.raycluster import toleration

INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"


def taint_tolerations(spec: ClusterSpec) -> list[dict[str, str]]:
    """One toleration per distinct worker taint, in a stable order."""
    seen = {(t.key, t.value, t.effect): toleration(t) for w in spec.workers for t in w.taints}
    return [seen[k] for k in sorted(seen)]


def _release(name: str, version: str, values: dict[str, Any]) -> dict[str, Any]:
    pin = catalog.chart(name)
    return {
        "name": name,
        "chart": pin.chart,
        "repo": pin.repo,
        "version": version,
        "namespace": pin.namespace,
        "createNamespace": pin.namespace != "kube-system",
        "values": values,
    }


def render_helm_releases(spec: ClusterSpec) -> list[dict[str, Any]]:
    """In install order. Each release is pinned and scheduled by node selector, never floating."""
    gpu_nodes = {"role": WORKER_ROLE}
    tolerations = taint_tolerations(spec)
    nvidia_tolerations = [
        # The chart's own defaults, kept because setting tolerations replaces them.
        {"key": "CriticalAddonsOnly", "operator": "Exists"},
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
    ] + [t for t in tolerations if t["key"] != "nvidia.com/gpu"]
    releases = []
    if spec.scheduler == "volcano":
        # Before KubeRay: its operator looks for Volcano's PodGroup CRD when batchScheduler.name is volcano.
        releases.append(_release("volcano", spec.versions.volcano, {}))
    releases += [
        _release("kuberay-operator", spec.versions.kuberay,
                 {"nodeSelector": dict(SYSTEM_LABELS), **kuberay_values(spec)}),
        _release(
            "nvidia-device-plugin",
            spec.versions.nvidia_device_plugin,
            {"nodeSelector": gpu_nodes, "tolerations": nvidia_tolerations},
        ),
    ]
    if spec.fabric == "efa":
        # The chart schedules only on instance types in its allowlist; listing this
        # cluster's types keeps a type newer than the chart from silently getting no plugin.
        types = sorted({w.instance_type for w in spec.workers})
        values: dict[str, Any] = {
            "nodeSelector": dict(gpu_nodes),
            "supportedInstanceLabels": {"keys": [INSTANCE_TYPE_LABEL], "values": types},
        }
        if tolerations:
            values["tolerations"] = tolerations
        releases.append(_release("aws-efa-k8s-device-plugin", spec.versions.efa_device_plugin, values))
    if spec.scheduler == "kueue":
        # After KubeRay: Kueue's ray.io integrations (on in the chart's defaults) need the Ray CRDs.
        releases.append(_release("kueue", spec.versions.kueue, {
            "controllerManager": {"nodeSelector": dict(SYSTEM_LABELS)},
            "managerConfig": {"controllerManagerConfigYaml": kueue_configuration()}}))
    return releases


def wait_for_pods_ready() -> dict[str, Any]:
    """Kueue evicts an admitted workload whose pods are not all Ready by then, giving its quota back; sized to the
    image pull and Ray's start on nodes that exist (catalog/scheduling.yaml `pods_ready`)."""
    ready = load_data("scheduling.yaml")["pods_ready"]
    return {"timeout": f"{(ready['image_pull_s'] + ready['ray_start_s']) // 60}m",
            "recoveryTimeout": f"{ready['recovery_s'] // 60}m",
            "requeuingStrategy": {"timestamp": "Eviction", "backoffBaseSeconds": 60, "backoffMaxSeconds": 3600}}


def kueue_configuration() -> str:
    """The chart's Configuration (catalog/kueue_config.yaml) with waitForPodsReady, as the one string it takes."""
    config = {**load_data("kueue_config.yaml"), "waitForPodsReady": wait_for_pods_ready()}
    return yaml.safe_dump(config, sort_keys=False, default_flow_style=False)


def chart_source(release: dict[str, Any]) -> list[str]:
    """How Helm names the release's chart: an OCI chart by its URL, others by name and --repo."""
    if release["repo"].startswith("oci://"):
        return [f"{release['repo'].rstrip('/')}/{release['chart']}"]
    return [release["chart"], "--repo", release["repo"]]


def helm_install_args(release: dict[str, Any], values_file: str) -> list[str]:
    """The idempotent `helm upgrade --install` argv for a rendered release (an OCI chart is named by its URL)."""
    args = [
        "helm", "upgrade", "--install", release["name"], *chart_source(release),
        "--version", release["version"],
        "--namespace", release["namespace"], "--values", values_file,
    ]
    if release["createNamespace"]:
        args.append("--create-namespace")
    return args
