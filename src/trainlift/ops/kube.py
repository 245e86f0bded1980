"""The Kubernetes side of a cluster, in one module: kubectl and helm through the runner.

kubectl, not a Python client, because: the kubeconfig of an EKS cluster authenticates
through an exec plugin (`aws eks get-token`) that kubectl runs natively; every command
trainlift runs is one the user can copy from the printed plan and run by hand; server-side
apply with a fixed field manager is one flag; and it adds no dependency. Helm is a CLI
anyway. State is read with `-o json` and parsed by the pure functions below; the
`Kube` class runs the commands and turns a missing tool into `Unknown` with the
install hint, so `status` and `--dry-run` never crash for want of a tool.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from trainlift.cloud.capacity import Unknown
from trainlift.errors import UsageError
from trainlift.ops.run import INSTALL, run
from trainlift.render.eksctl import WORKER_GROUP_LABEL
from trainlift.render.fit import EPHEMERAL, HUGEPAGES, cpu_m, mem_mib
from trainlift.render.raycluster import EFA_RESOURCE, GPU_RESOURCE

FIELD_MANAGER = "trainlift"
SPEC_HASH = "trainlift.io/spec-sha256"
# What Helm (>= 3.2) reads to adopt an object it did not create.
HELM_RELEASE = "meta.helm.sh/release-name"
HELM_NAMESPACE = "meta.helm.sh/release-namespace"
MANAGED_BY = "app.kubernetes.io/managed-by"
TIMEOUT_S = 60
REQUEST_TIMEOUT = "20s"


@dataclass(frozen=True)
class Node:
    name: str
    role: str | None
    group: str | None
    instance_type: str | None
    zone: str | None
    ready: bool
    gpus: int
    efa: int
    cpu_m: int = 0  # .status.allocatable; 0: not reported
    mem_mib: int = 0
    hugepages_mib: int | None = None  # None: not reported
    ephemeral_mib: int | None = None


@dataclass(frozen=True)
class Release:
    name: str
    namespace: str
    status: str
    chart: str
    app_version: str = ""

    @property
    def version(self) -> str:
        """The chart version: what follows the chart name in `chart` (kuberay-operator-1.4.0 -> 1.4.0)."""
        parts = self.chart.split("-")
        for i in range(1, len(parts)):
            if parts[i][:1].isdigit() or (parts[i][:1] == "v" and parts[i][1:2].isdigit()):
                return "-".join(parts[i:])
        return ""


@dataclass(frozen=True)
class RayState:
    exists: bool
    spec_hash: str | None = None
    state: str | None = None
    head_ready: bool = False
    workers_running: int = 0


def _int(value: Any) -> int:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return 0


def _items(text: str) -> list[dict[str, Any]]:
    data = json.loads(text) if text.strip().startswith(("{", "[")) else yaml.safe_load(text)
    if isinstance(data, list):
        return data
    return data.get("items", [data]) if isinstance(data, dict) else []


def parse_nodes(text: str) -> list[Node]:
    """`kubectl get nodes -o json`."""
    nodes = []
    for item in _items(text):
        meta, status = item.get("metadata", {}), item.get("status", {})
        labels = meta.get("labels") or {}
        allocatable = status.get("allocatable") or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        nodes.append(Node(
            name=meta.get("name", ""),
            role=labels.get("role"),
            group=labels.get(WORKER_GROUP_LABEL) or labels.get("eks.amazonaws.com/nodegroup")
            or labels.get("alpha.eksctl.io/nodegroup-name"),
            instance_type=labels.get("node.kubernetes.io/instance-type") or labels.get("beta.kubernetes.io/instance-type"),
            zone=labels.get("topology.kubernetes.io/zone") or labels.get("failure-domain.beta.kubernetes.io/zone"),
            ready=ready,
            gpus=_int(allocatable.get(GPU_RESOURCE)),
            efa=_int(allocatable.get(EFA_RESOURCE)),
            cpu_m=cpu_m(allocatable["cpu"]) if "cpu" in allocatable else 0,
            mem_mib=mem_mib(allocatable["memory"]) if "memory" in allocatable else 0,
            hugepages_mib=mem_mib(allocatable[HUGEPAGES]) if HUGEPAGES in allocatable else None,
            ephemeral_mib=mem_mib(allocatable[EPHEMERAL]) if EPHEMERAL in allocatable else None,
        ))
    return nodes


def parse_helm_list(text: str) -> dict[str, Release]:
    """`helm list -A -o json` (the -o yaml form parses too)."""
    out = {}
    for item in _items(text) if text.strip() else []:
        out[item["name"]] = Release(item["name"], item.get("namespace", ""), str(item.get("status", "")),
                                    str(item.get("chart", "")), str(item.get("app_version", "")))
    return out


def parse_names(text: str) -> frozenset[str]:
    return frozenset(i.get("metadata", {}).get("name", "") for i in _items(text))


def parse_daemonsets(text: str) -> dict[str, str]:
    """`kubectl get daemonsets -o json`: name -> the Helm release that owns it ("" when Helm does not)."""
    out = {}
    for item in _items(text):
        meta = item.get("metadata", {})
        helm = (meta.get("labels") or {}).get(MANAGED_BY) == "Helm"
        out[meta.get("name", "")] = (meta.get("annotations") or {}).get(HELM_RELEASE, "") if helm else ""
    return out


def parse_raycluster(cluster_json: str | None, pods_json: str) -> RayState:
    if not cluster_json:
        return RayState(exists=False)
    rc = json.loads(cluster_json)
    head_ready, workers = False, 0
    for pod in _items(pods_json):
        labels = pod.get("metadata", {}).get("labels") or {}
        status = pod.get("status") or {}
        kind = labels.get("ray.io/node-type")
        if kind == "head":
            head_ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        elif kind == "worker" and status.get("phase") == "Running":
            workers += 1
    return RayState(
        exists=True,
        spec_hash=(rc.get("metadata", {}).get("annotations") or {}).get(SPEC_HASH),
        state=(rc.get("status") or {}).get("state"),
        head_ready=head_ready,
        workers_running=workers,
    )


# --- command lines (pure) --------------------------------------------------------------------

@dataclass(frozen=True)
class ImagePull:
    pod: str
    node: str
    image: str
    seconds: float | None  # None: the image was already on the node


# kubelet's events (pkg/kubelet/images/image_manager.go): `Successfully pulled image "IMG" in 4m32.1s (4m32.1s
# including waiting). Image size: N bytes.` and `Container image "IMG" already present on machine`.
_PULLED = re.compile(r'Successfully pulled image "([^"]+)" in ([0-9hms.µ]+)')
_PRESENT = re.compile(r'Container image "([^"]+)" already present on machine')


def go_duration_s(text: str) -> float:
    """A Go duration (`4m32.123s`, `1h2m`, `850ms`) in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6}
    return sum(float(n) * units[u] for n, u in re.findall(r"([0-9.]+)(ms|us|µs|h|m|s)", text))


def parse_pull_events(text: str) -> list[ImagePull]:
    """`kubectl get events -o json`: each pod's image pull (or the image already present) from kubelet's events."""
    pulls = []
    for e in _items(text):
        message, pod = e.get("message", ""), (e.get("involvedObject") or {}).get("name", "")
        node = (e.get("source") or {}).get("host", "") or e.get("reportingInstance", "")
        if m := _PULLED.search(message):
            pulls.append(ImagePull(pod, node, m.group(1), go_duration_s(m.group(2))))
        elif m := _PRESENT.search(message):
            pulls.append(ImagePull(pod, node, m.group(1), None))
    return pulls


def kubectl(kubeconfig: str, *args: str) -> list[str]:
    return ["kubectl", "--kubeconfig", kubeconfig, *args]


def apply(kubeconfig: str, path: str) -> list[str]:
    return kubectl(kubeconfig, "apply", "--server-side", f"--field-manager={FIELD_MANAGER}", "-f", path)


def helm_install(kubeconfig: str, args: list[str], wait: bool) -> list[str]:
    """A rendered `helm upgrade --install` argv, pointed at the cluster's kubeconfig."""
    out = [*args, "--kubeconfig", kubeconfig]
    return out + (["--wait", "--timeout", "10m"] if wait else [])


def helm_adopt(kubeconfig: str, kind: str, name: str, namespace: str, release: str) -> list[str]:
    """Mark an object Helm did not create as the release's, so `helm upgrade --install` takes it over."""
    patch = {"metadata": {"labels": {MANAGED_BY: "Helm"},
                          "annotations": {HELM_RELEASE: release, HELM_NAMESPACE: namespace}}}
    return kubectl(kubeconfig, "-n", namespace, "patch", kind, name, "--type=merge",
                   "-p", json.dumps(patch, sort_keys=True, separators=(",", ":")))


def ray_selector(cluster: str, node_type: str) -> str:
    return f"ray.io/cluster={cluster},ray.io/node-type={node_type}"


def kubeconfig_for(name: str, region: str, endpoint: str, ca_data: str) -> dict[str, Any]:
    """A kubeconfig for an EKS cluster that authenticates with `aws eks get-token` (no secret inside)."""
    user = f"trainlift-{name}"
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": {"server": endpoint, "certificate-authority-data": ca_data}}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": user}}],
        "current-context": name,
        "users": [{"name": user, "user": {"exec": {
            "apiVersion": "client.authentication.k8s.io/v1beta1",
            "command": "aws",
            "args": ["eks", "get-token", "--cluster-name", name, "--output", "json", "--region", region],
            "interactiveMode": "Never",
        }}}],
    }


# --- observation (runs kubectl / helm) ---------------------------------------------------------

def kube_for(kubeconfig) -> "Kube":
    """A Kube on a kubeconfig file; one line (exit 2) when there is no such file."""
    if not Path(kubeconfig).is_file():
        raise UsageError(f"--kubeconfig {kubeconfig}: no such file",
                         hint="`trainlift cluster up` writes it to .trainlift/<cluster>/kubeconfig")
    return Kube(str(kubeconfig))


class Kube:
    """Read the cluster through kubectl and helm; any failure is `Unknown(reason)`."""

    def __init__(self, kubeconfig: str):
        self.kubeconfig = kubeconfig

    def _get(self, tool: str, args: list[str]) -> str | Unknown:
        if tool == "kubectl":
            cmd = kubectl(self.kubeconfig, f"--request-timeout={REQUEST_TIMEOUT}", *args)
        else:
            cmd = [tool, *args, "--kubeconfig", self.kubeconfig]
        got = run(cmd, TIMEOUT_S)
        if got.absent:
            return Unknown(f"{tool} not found ({INSTALL[tool]})")
        if got.timed_out:
            return Unknown(f"{tool} {' '.join(args[:2])} timed out after {TIMEOUT_S} s")
        if not got.ok:
            return Unknown(f"{tool} {' '.join(args[:2])} failed: {' '.join(got.stderr.split())[-300:]}")
        return got.stdout

    def image_pulls(self, namespace: str) -> list[ImagePull] | Unknown:
        out = self._get("kubectl", ["get", "events", "-n", namespace, "--field-selector", "reason=Pulled",
                                    "-o", "json"])
        return out if isinstance(out, Unknown) else parse_pull_events(out)

    def nodes(self) -> list[Node] | Unknown:
        out = self._get("kubectl", ["get", "nodes", "-o", "json"])
        return out if isinstance(out, Unknown) else parse_nodes(out)

    def releases(self) -> dict[str, Release] | Unknown:
        out = self._get("helm", ["list", "--all-namespaces", "-o", "json"])
        return out if isinstance(out, Unknown) else parse_helm_list(out)

    def namespaces(self) -> frozenset[str] | Unknown:
        out = self._get("kubectl", ["get", "namespaces", "-o", "json"])
        return out if isinstance(out, Unknown) else parse_names(out)

    def names(self, kind: str, namespace: str) -> frozenset[str] | Unknown:
        out = self._get("kubectl", ["get", kind, "-n", namespace, "-o", "json"])
        return out if isinstance(out, Unknown) else parse_names(out)

    def daemonsets(self, namespace: str) -> dict[str, str] | Unknown:
        out = self._get("kubectl", ["get", "daemonsets", "-n", namespace, "-o", "json"])
        return out if isinstance(out, Unknown) else parse_daemonsets(out)

    def raycluster(self, namespace: str, name: str) -> RayState | Unknown:
        found = self._get("kubectl", ["get", "rayclusters.ray.io", "-n", namespace, "--field-selector",
                                      f"metadata.name={name}", "-o", "json"])
        if isinstance(found, Unknown):
            if "the server doesn't have a resource type" in found.reason:
                return RayState(exists=False)
            return found
        items = _items(found)
        if not items:
            return RayState(exists=False)
        pods = self._get("kubectl", ["get", "pods", "-n", namespace, "-l", f"ray.io/cluster={name}", "-o", "json"])
        return parse_raycluster(json.dumps(items[0]), "[]" if isinstance(pods, Unknown) else pods)

    def rayjob_workload(self, namespace: str, name: str) -> tuple[dict | None, dict | None] | Unknown:
        """The Kueue Workload of RayJob `name` (found by the job-uid label Kueue puts on it) and, while it is
        pending, its LocalQueue's pending workloads from Kueue's visibility API (None where that is not served)."""
        job = self._get("kubectl", ["get", "rayjobs.ray.io", name, "-n", namespace, "-o", "json"])
        if isinstance(job, Unknown):
            return job
        uid = json.loads(job).get("metadata", {}).get("uid", "")
        found = self._get("kubectl", ["get", "workloads.kueue.x-k8s.io", "-n", namespace, "-l",
                                      f"kueue.x-k8s.io/job-uid={uid}", "-o", "json"])
        if isinstance(found, Unknown):
            return found
        items = _items(found)
        if not items:
            return None, None
        workload = items[0]
        queue = (workload.get("spec") or {}).get("queueName")
        if not queue or (workload.get("status") or {}).get("admission"):
            return workload, None
        raw = self._get("kubectl", ["get", "--raw", f"/apis/visibility.kueue.x-k8s.io/v1beta2/namespaces/{namespace}"
                                                    f"/localqueues/{queue}/pendingworkloads"])
        return workload, None if isinstance(raw, Unknown) else json.loads(raw)

    def job_topology(self, namespace: str, ray_cluster: str) -> tuple[list[dict], list[dict]] | Unknown:
        """The pods of a RayCluster and every node (their labels carry the network topology)."""
        pods = self._get("kubectl", ["get", "pods", "-n", namespace, "-l", f"ray.io/cluster={ray_cluster}",
                                     "-o", "json"])
        if isinstance(pods, Unknown):
            return pods
        nodes = self._get("kubectl", ["get", "nodes", "-o", "json"])
        return nodes if isinstance(nodes, Unknown) else (_items(pods), _items(nodes))
