"""ClusterSpec -> KubeRay RayCluster: a CPU head on the system nodes, one worker pod per GPU node."""

from __future__ import annotations

import math
from typing import Any

from trainlift import catalog
from trainlift.config.cluster import ClusterSpec, Taint, WorkerGroup
from trainlift.doctor.nccl_log import NCCL_DEBUG_ENV
from trainlift.render.eksctl import SYSTEM_LABELS, WORKER_GROUP_LABEL, WORKER_ROLE

EFA_RESOURCE = "vpc.amazonaws.com/efa"
GPU_RESOURCE = "nvidia.com/gpu"
POD_INTERFACE = "eth0"
MANAGED_BY = {"app.kubernetes.io/managed-by": "trainlift"}

# Share of an instance left to the kubelet, system daemons (VPC CNI, kube-proxy,
# device plugins) and, on the system nodes, the KubeRay operator and CoreDNS.
WORKER_RESERVE = (0.10, 2, 4)  # fraction, at least this many vCPUs, at least this many GiB
HEAD_RESERVE = (0.25, 1, 4)
SHM_SHARE = 4  # /dev/shm may use up to 1/4 of the pod's memory (it counts against the limit)


def pod_size(profile: catalog.InstanceProfile, reserve: tuple[float, int, int]) -> tuple[int, int]:
    """(vCPUs, GiB) a pod can request on one node of this type, after headroom."""
    fraction, min_cpu, min_gib = reserve
    gib = int(profile.memory_gib)
    cpu = profile.vcpus - max(min_cpu, math.ceil(profile.vcpus * fraction))
    mem = gib - max(min_gib, math.ceil(gib * fraction))
    return max(cpu, 1), max(mem, 1)


def fabric_env(spec: ClusterSpec) -> dict[str, str]:
    nccl = catalog.platform()["nccl"]
    debug = NCCL_DEBUG_ENV
    if spec.fabric == "efa":
        # NCCL_NET pinned to the plugin's network: a plugin that fails to load
        # becomes an error instead of a silent fall back to TCP sockets.
        return {
            "FI_PROVIDER": "efa",
            "NCCL_NET_PLUGIN": nccl["ofi_plugin"],
            "NCCL_NET": nccl["ofi_network"],
            "NCCL_SOCKET_IFNAME": POD_INTERFACE,
            **debug,
        }
    return {"NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": POD_INTERFACE, **debug}


def _env(values: dict[str, str], spec: ClusterSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in {**values, **spec.env}.items()]
    for ref in spec.secrets:
        key_ref: dict[str, Any] = {"name": ref.secret, "key": ref.key}
        if ref.optional:
            key_ref["optional"] = True
        env.append({"name": ref.env, "valueFrom": {"secretKeyRef": key_ref}})
    return env


def _resources(amounts: dict[str, str]) -> dict[str, dict[str, str]]:
    return {"limits": dict(amounts), "requests": dict(amounts)}


def _volumes(spec: ClusterSpec, shm_gib: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts): Ray's logs and spill, /dev/shm in memory, and the checkpoint volume."""
    volumes: list[dict[str, Any]] = [
        {"name": "ray-logs", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm_gib}Gi"}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "ray-logs", "mountPath": "/tmp/ray"},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    fsx = spec.storage.fsx if spec.storage else None
    if fsx is not None:
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": fsx.claim}})
        mounts.append({"name": "checkpoints", "mountPath": fsx.mount_path})
    return volumes, mounts


def service_account(spec: ClusterSpec) -> dict[str, str]:
    s3 = spec.storage.s3 if spec.storage else None
    return {"serviceAccountName": s3.service_account} if s3 else {}


def _container(spec: ClusterSpec, name: str, env: list[dict[str, Any]], resources: dict[str, str],
               mounts: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "name": name,
        "image": spec.image.uri,
        "imagePullPolicy": spec.image.pull_policy,
        "env": env,
        "resources": _resources(resources),
        "volumeMounts": mounts,
        "lifecycle": {"preStop": {"exec": {"command": ["/bin/sh", "-c", "ray stop"]}}},
    }


def head_group(spec: ClusterSpec) -> dict[str, Any]:
    cpu, gib = pod_size(catalog.lookup(spec.system.instance_type), HEAD_RESERVE)
    volumes, mounts = _volumes(spec, max(1, gib // SHM_SHARE))
    # The node runtime's NVIDIA hook fails on GPU-less nodes unless the pod opts out.
    env = _env({"NVIDIA_VISIBLE_DEVICES": "void"}, spec)
    container = _container(spec, "ray-head", env, {"cpu": str(cpu), "memory": f"{gib}Gi"}, mounts)
    container["ports"] = [
        {"containerPort": 6379, "name": "gcs-server"},
        {"containerPort": 8265, "name": "dashboard"},
        {"containerPort": 10001, "name": "client"},
    ]
    return {
        "serviceType": "ClusterIP",
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-gpus": "0"},
        "template": {
            "metadata": {"labels": dict(MANAGED_BY)},
            "spec": {
                "nodeSelector": dict(SYSTEM_LABELS),
                **service_account(spec),
                "containers": [container],
                "volumes": volumes,
            },
        },
    }


def toleration(t: Taint) -> dict[str, str]:
    """The toleration of a worker group's taint (any value when the taint has none)."""
    if t.value:
        return {"key": t.key, "operator": "Equal", "value": t.value, "effect": t.effect}
    return {"key": t.key, "operator": "Exists", "effect": t.effect}


def tolerations(w: WorkerGroup) -> list[dict[str, str]]:
    return [toleration(t) for t in w.taints]


def worker_group(spec: ClusterSpec, w: WorkerGroup) -> dict[str, Any]:
    profile = w.profile
    cpu, gib = pod_size(profile, WORKER_RESERVE)
    gpus = w.gpus_per_worker
    amounts = {"cpu": str(cpu), "memory": f"{gib}Gi", GPU_RESOURCE: str(gpus)}
    if spec.fabric == "efa":
        amounts[EFA_RESOURCE] = str(profile.efa_interfaces)
    volumes, mounts = _volumes(spec, max(1, gib // SHM_SHARE))
    container = _container(spec, "ray-worker", _env(fabric_env(spec), spec), amounts, mounts)
    # Locked (pinned) memory for EFA and NCCL buffers.
    container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    pod: dict[str, Any] = {"nodeSelector": {"role": WORKER_ROLE, WORKER_GROUP_LABEL: w.name}}
    if w.taints:
        pod["tolerations"] = tolerations(w)
    pod.update(service_account(spec))
    pod["containers"] = [container]
    pod["volumes"] = volumes
    return {
        "groupName": w.name,
        "replicas": w.count,
        "minReplicas": w.count,
        "maxReplicas": w.count,
        "rayStartParams": {"num-gpus": str(gpus)},
        "template": {"metadata": {"labels": dict(MANAGED_BY)}, "spec": pod},
    }


def raycluster_spec(spec: ClusterSpec) -> dict[str, Any]:
    return {
        "rayVersion": spec.ray_version,
        "enableInTreeAutoscaling": False,
        "headGroupSpec": head_group(spec),
        "workerGroupSpecs": [worker_group(spec, w) for w in spec.workers],
    }


def render_raycluster(spec: ClusterSpec) -> dict[str, Any]:
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": spec.name, "namespace": spec.namespace, "labels": dict(MANAGED_BY)},
        "spec": raycluster_spec(spec),
    }
