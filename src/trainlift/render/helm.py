"""ClusterSpec -> Helm releases: NVIDIA device plugin, AWS EFA device plugin, KubeRay operator, and the scheduler
(Kueue or Volcano) the spec names."""

from __future__ import annotations

import shlex
from typing import Any

import yaml

from trainlift import catalog
from trainlift.catalog.lookup import load_data
from trainlift.config.cluster import ClusterSpec
from trainlift.render.cold_start import cold_start
from trainlift.render.eksctl import SYSTEM_LABELS, WORKER_ROLE
from trainlift.render.queues import kuberay_values
from trainlift.render.raycluster import toleration

INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"


def taint_tolerations(spec: ClusterSpec) -> list[dict[str, str]]:
    """One toleration per distinct worker taint, in a stable order."""
    seen = {(t.key, t.value, t.effect): toleration(t) for w in spec.workers for t in w.taints}
    return [seen[k] for k in sorted(seen)]


def expected_digest(spec: ClusterSpec, name: str, version: str) -> tuple[str | None, str]:
    """(sha256:<hex> the release's chart archive must have, where that pin comes from), or (None, "") when only
    the version pins it: the spec's `versions.chart_digests` first, then the catalog's for its pinned version."""
    if name in spec.versions.chart_digests:
        return spec.versions.chart_digests[name], "versions.chart_digests"
    digest = catalog.chart(name).digests.get(version)
    return (digest, "trainlift's catalog") if digest else (None, "")


def _release(spec: ClusterSpec, name: str, version: str, values: dict[str, Any]) -> dict[str, Any]:
    pin = catalog.chart(name)
    digest, digest_from = expected_digest(spec, name, version)
    return {
        "name": name,
        "chart": pin.chart,
        "repo": pin.repo,
        "version": version,
        "digest": digest,
        "digestFrom": digest_from,
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
        releases.append(_release(spec, "volcano", spec.versions.volcano, {}))
    releases += [
        _release(spec, "kuberay-operator", spec.versions.kuberay,
                 {"nodeSelector": dict(SYSTEM_LABELS), **kuberay_values(spec)}),
        _release(
            spec, "nvidia-device-plugin",
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
        releases.append(_release(spec, "aws-efa-k8s-device-plugin", spec.versions.efa_device_plugin, values))
    if spec.scheduler == "kueue":
        # After KubeRay: Kueue's ray.io integrations (on in the chart's defaults) need the Ray CRDs.
        releases.append(_release(spec, "kueue", spec.versions.kueue, {
            "controllerManager": {"nodeSelector": dict(SYSTEM_LABELS)},
            "managerConfig": {"controllerManagerConfigYaml": kueue_configuration(spec)}}))
    return releases


def wait_for_pods_ready(spec: ClusterSpec) -> dict[str, Any]:
    """Kueue evicts an admitted workload whose pods are not all Ready by then, giving its quota back; sized to the
    image's modelled first pull on the slowest group, with headroom, and Ray's start on nodes that exist
    (render/cold_start.py)."""
    ready = load_data("scheduling.yaml")["pods_ready"]
    return {"timeout": f"{cold_start(spec).pods_ready_timeout_m}m",
            "recoveryTimeout": f"{ready['recovery_s'] // 60}m",
            "requeuingStrategy": {"timestamp": "Eviction", "backoffBaseSeconds": 60, "backoffMaxSeconds": 3600}}


def kueue_configuration(spec: ClusterSpec) -> str:
    """The chart's Configuration (catalog/kueue_config.yaml) with waitForPodsReady, as the one string it takes."""
    config = {**load_data("kueue_config.yaml"), "waitForPodsReady": wait_for_pods_ready(spec)}
    return yaml.safe_dump(config, sort_keys=False, default_flow_style=False)


def chart_source(release: dict[str, Any]) -> list[str]:
    """How Helm names the release's chart: an OCI chart by its URL, others by name and --repo."""
    if release["repo"].startswith("oci://"):
        return [f"{release['repo'].rstrip('/')}/{release['chart']}"]
    return [release["chart"], "--repo", release["repo"]]


def chart_archive(release: dict[str, Any]) -> str:
    """The file `helm pull` writes for the release's chart version."""
    return f"{release['chart']}-{release['version']}.tgz"


def helm_pull_args(release: dict[str, Any], destination: str) -> list[str]:
    return ["helm", "pull", *chart_source(release), "--version", release["version"], "--destination", destination]


def helm_install_args(release: dict[str, Any], values_file: str, chart_file: str | None = None) -> list[str]:
    """The idempotent `helm upgrade --install` argv for a rendered release: from `chart_file`, the pulled and
    checked archive, or else from its repository by version (an OCI chart is named by its URL)."""
    source = [chart_file] if chart_file else [*chart_source(release), "--version", release["version"]]
    args = [
        "helm", "upgrade", "--install", release["name"], *source,
        "--namespace", release["namespace"], "--values", values_file,
    ]
    if release["createNamespace"]:
        args.append("--create-namespace")
    return args


def install_commands(release: dict[str, Any], values_file: str) -> str:
    """The commands that install a rendered release by hand, its chart archive checked where a digest pins it."""
    archive = f"charts/{chart_archive(release)}"
    pull = shlex.join(helm_pull_args(release, "charts"))
    if release["digest"] and release["repo"].startswith("oci://"):
        # An OCI chart is pinned by its manifest digest, which Helm prints as it pulls.
        lines = [f"{pull} 2>&1 | grep -Fx 'Digest: {release['digest']}'"]
    elif release["digest"]:
        lines = [pull, f"echo '{release['digest'].removeprefix('sha256:')}  {archive}' | sha256sum -c"]
    else:
        lines = [pull]
    lines.append(shlex.join(helm_install_args(release, values_file, archive)))
    return "\n".join(lines)


def digest_line(release: dict[str, Any]) -> str:
    """How the release's chart is pinned, for render and `cluster up` to print."""
    what = f"{release['name']} {release['version']}"
    if release["digest"]:
        return f"{what} pinned by digest {release['digest']} ({release['digestFrom']})"
    looked = catalog.chart(release["name"]).digest_source
    where = f" (looked up: {looked.split(':')[0]})" if looked else ""
    return (f"{what} pinned by version only: trainlift knows no digest for it{where}; `cluster up` records the "
            "digest it first pulls and refuses another (versions.chart_digests pins one)")
