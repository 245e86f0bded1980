"""ClusterSpec -> KubeRay RayCluster: a CPU head on the system nodes, one worker pod per GPU node."""

from __future__ import annotations

import math
from typing import Any, Callable

from trainlift import catalog
from trainlift.catalog.lookup import pinned_image
from trainlift.config.cluster import ClusterSpec, Taint, WorkerGroup
from trainlift.doctor.nccl_log import NCCL_DEBUG_ENV
from trainlift.train.model.fetch import STAGING_ENV
from trainlift.render import fit, stop_hooks
from trainlift.render.image_cache import UPSTREAM, cached_uri
from trainlift.render.eksctl import SYSTEM_LABELS, WORKER_GROUP_LABEL, WORKER_ROLE, head_zones

EFA_RESOURCE = "vpc.amazonaws.com/efa"
GPU_RESOURCE = "nvidia.com/gpu"
HUGEPAGES_RESOURCE = "hugepages-2Mi"
EPHEMERAL_RESOURCE = "ephemeral-storage"
POD_INTERFACE = "eth0"
MANAGED_BY = {"app.kubernetes.io/managed-by": "trainlift"}
ZONE_LABEL = "topology.kubernetes.io/zone"  # the well-known label kubelet sets from the node's AZ

# Share of an instance left to the kubelet, system daemons (VPC CNI, kube-proxy,
# device plugins) and, on the system nodes, the KubeRay operator and CoreDNS.
WORKER_RESERVE = (0.10, 2, 4)  # fraction, at least this many vCPUs, at least this many GiB
HEAD_RESERVE = (0.25, 1, 4)
HEAD_FLOOR = (1000, 2)  # millicores, GiB: less than this is no Ray head
SHM_SHARE = 4  # /dev/shm may use up to 1/4 of the pod's memory (it counts against the limit)

# The staging volume: checkpoints are written there before their upload (and the node's model cache lives there).
# Worker nodes RAID0 their instance-store NVMe under kubelet's directory (render.eksctl), so an emptyDir is on the
# NVMe, never the root disk. The pod's ephemeral-storage request is the array less kubelet's default hard eviction
# threshold (nodefs.available < 10%, Kubernetes "Node-pressure Eviction") and room for the image, which containerd
# unpacks onto the same array (the Ray DLC is tens of GiB); the staging volume is that less the pod's own scratch
# (writable layer, Ray's logs and spill).
STAGING_PATH = "/mnt/trainlift-staging"
NODEFS_EVICTION_SHARE = 0.10
IMAGE_RESERVE_GIB = 60
POD_SCRATCH_GIB = 20

# `jobs stop` (Ray's stop_job) sends SIGTERM to the job's driver, which then finishes the step in flight, writes a
# checkpoint and exits; Ray SIGKILLs it RAY_JOB_STOP_WAIT_TIME_S seconds after the SIGTERM, 3 s unless set (Ray's
# job supervisor, ray/dashboard/modules/job: DEFAULT_RAY_JOB_STOP_WAIT_TIME_S = 3; docs: JobSubmissionClient.stop_job
# "attempts to terminate process first, then kills process after timeout"). The head's job supervisor reads it from
# its environment. trainlift sets it to
#     STOP_FLOOR_S + (bits one node checkpoints) / (bits per second it writes), rounded up,
# where a node checkpoints at most its GPUs' memory (FSDP keeps each rank's parameter and optimizer shards there)
# and writes at a quarter of its network bandwidth, capped at a quarter of storage's per-instance ceiling
# (platform.yaml checkpoint_write). The floor covers the step in flight and the driver's exit.
# g6.12xlarge: 60 s + 4 x 22888 MiB at 10 Gb/s = 137 s; p5.48xlarge: 60 s + 8 x 80 GiB at 25 Gb/s = 280 s.
STOP_FLOOR_S = 60
WRITE_SHARE = 4

# Ray's token authentication, turned on by KubeRay (`authOptions.mode: token`, KubeRay >= 1.5.1, Ray >= 2.52.0:
# ray-operator/controllers/ray/utils/validation.go@v1.7.0). With no `secretName`, the operator creates a Secret named
# after the RayCluster holding a random token under the key `auth_token` (raycluster_controller.go,
# reconcileAuthSecret), and sets RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (a secretKeyRef to it) in the Ray containers
# and in a RayJob's submitter (common/pod.go, SetContainerTokenAuthEnvVars). The token never appears in a manifest;
# trainlift reads it from the Secret with kubectl when it reaches the head (ops.jobs.cluster_token).
TOKEN_AUTH_MIN_RAY = "2.52.0"
TOKEN_AUTH_MIN_KUBERAY = "1.5.1"
AUTH_TOKEN_KEY = "auth_token"


# The Ray containers run as the image's user (the Ray Train DLC's Dockerfile sets no USER: root), so no runAsNonRoot;
# they get no Linux capabilities beyond IPC_LOCK on workers (memory EFA and NCCL pin), cannot gain privileges, and
# run under the container runtime's default seccomp profile.
def security_context(*add: str) -> dict[str, Any]:
    capabilities: dict[str, list[str]] = {"add": list(add)} if add else {}
    return {"allowPrivilegeEscalation": False, "capabilities": {**capabilities, "drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"}}


# No Ray container calls the Kubernetes API (there is no in-tree autoscaler: `enableInTreeAutoscaling: false`), so
# no Ray pod gets an API token. The S3 role's web identity token is a volume of its own (the EKS pod identity
# webhook adds it), which this does not remove.
NO_API_TOKEN = {"automountServiceAccountToken": False}

# The ports the Ray pods listen on, for the NetworkPolicy (network_policy.py). Ray's fixed ones: GCS, dashboard
# (Jobs API), Ray client, the dashboard agent's HTTP port, and the range its worker processes listen in (Ray's
# defaults; Ray docs, "Configuring Ports"). Every other Ray server (raylet, object manager, the agents' gRPC) binds
# port 0 by default, as do the job's own connections (torch's TCPStore, gloo's and NCCL's sockets): the kernel picks
# those from its ephemeral range (net.ipv4.ip_local_port_range, 32768-60999 unless the node changes it).
GCS_PORT, DASHBOARD_PORT, CLIENT_PORT, AGENT_PORT = 6379, 8265, 10001, 52365
WORKER_PORTS = (10002, 19999)
EPHEMERAL_PORTS = (32768, 60999)


def pod_size(profile: catalog.InstanceProfile, reserve: tuple[float, int, int]) -> tuple[int, int]:
    """(vCPUs, GiB) a pod can request on one node of this type, after headroom."""
    fraction, min_cpu, min_gib = reserve
    gib = int(profile.memory_gib)
    cpu = profile.vcpus - max(min_cpu, math.ceil(profile.vcpus * fraction))
    mem = gib - max(min_gib, math.ceil(gib * fraction))
    return max(cpu, 1), max(mem, 1)


def ephemeral_gib(profile: catalog.InstanceProfile) -> int:
    """Ephemeral storage a worker pod requests on one node of this type: its NVMe array less headroom (above)."""
    nvme_gib = profile.local_nvme_gb * 1e9 / 2**30
    return max(0, math.floor(nvme_gib * (1 - NODEFS_EVICTION_SHARE)) - IMAGE_RESERVE_GIB)


def staging_gib(profile: catalog.InstanceProfile) -> int:
    """Size of the staging volume of a worker pod on this type (0: the type has no local NVMe)."""
    return max(0, ephemeral_gib(profile) - POD_SCRATCH_GIB)


def fabric_env(spec: ClusterSpec) -> dict[str, str]:
    nccl = catalog.platform()["nccl"]
    debug = NCCL_DEBUG_ENV
    if spec.fabric == "efa":
        # NCCL_NET pinned to the plugin's network: a plugin that fails to load
        # becomes an error instead of a silent fall back to TCP sockets. Nothing else of libfabric's
        # is set: aws-ofi-nccl's doc/efa-env-var.md calls FI_PROVIDER=efa, FI_EFA_FORK_SAFE and
        # NCCL_PROTO=simple unneeded with current plugins and FI_EFA_USE_DEVICE_RDMA, RDMAV_* "do not use".
        return {
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


def stop_wait_seconds(spec: ClusterSpec) -> int:
    """RAY_JOB_STOP_WAIT_TIME_S for the head: time for a stopped job's final checkpoint (formula above)."""
    ceiling = float(catalog.platform()["checkpoint_write"]["max_gbps"])
    write_s = 0.0
    for w in spec.workers:
        profile = w.profile
        bits = profile.gpus * profile.gpu_memory_mib * 2**20 * 8
        rate = min(profile.network_gbps, ceiling) / WRITE_SHARE * 1e9
        write_s = max(write_s, bits / rate)
    return STOP_FLOOR_S + math.ceil(write_s)


def auth_secret_name(spec: ClusterSpec) -> str:
    """The Secret KubeRay creates with the standing RayCluster's token: the RayCluster's name (KubeRay's CheckName
    keeps a name of at most 50 characters that starts with a letter, as every cluster spec's name does)."""
    return spec.name


def image_ref(spec: ClusterSpec) -> str:
    """The image the pods run: a digest reference as given, a floating catalog tag as the release it stands for,
    any other image as written; through the ECR cache with `image.cache: ecr`."""
    uri = pinned_image(spec.image.uri) or spec.image.uri
    if spec.image.cache == "ecr" and spec.image.account and uri.startswith(UPSTREAM + "/"):
        return cached_uri(uri, spec.image.account, spec.region)
    return uri


def _container(spec: ClusterSpec, name: str, env: list[dict[str, Any]], resources: dict[str, str],
               mounts: list[dict[str, Any]], stop_script: str) -> dict[str, Any]:
    return {
        "name": name,
        "image": image_ref(spec),
        "imagePullPolicy": spec.image.pull_policy,
        "env": env,
        "resources": _resources(resources),
        "volumeMounts": mounts,
        "lifecycle": stop_hooks.pre_stop(stop_script),
        "securityContext": security_context(),
    }


def head_group(spec: ClusterSpec) -> dict[str, Any]:
    """The head takes what the system node has left after the add-ons, operators and submitter (render.fit), at
    most HEAD_RESERVE's share of the node."""
    cpu, gib = pod_size(catalog.lookup(spec.system.instance_type), HEAD_RESERVE)
    left = fit.room(spec, spec.system.instance_type, system=True)
    # A node too small for any head keeps a floor here, and render's scheduling check refuses it with the numbers.
    cpu_m = max(HEAD_FLOOR[0], min(cpu * 1000, left.cpu_m // 100 * 100))
    gib = max(HEAD_FLOOR[1], min(gib, left.mem_mib // 1024))
    volumes, mounts = _volumes(spec, max(1, gib // SHM_SHARE))
    # The node runtime's NVIDIA hook fails on GPU-less nodes unless the pod opts out.
    env = _env({"NVIDIA_VISIBLE_DEVICES": "void", "RAY_JOB_STOP_WAIT_TIME_S": str(stop_wait_seconds(spec))}, spec)
    amounts = {"cpu": str(cpu_m // 1000) if cpu_m % 1000 == 0 else f"{cpu_m}m", "memory": f"{gib}Gi"}
    container = _container(spec, "ray-head", env, amounts, mounts, stop_hooks.HEAD_WAIT)
    container["ports"] = [
        {"containerPort": GCS_PORT, "name": "gcs-server"},
        {"containerPort": DASHBOARD_PORT, "name": "dashboard"},
        {"containerPort": CLIENT_PORT, "name": "client"},
    ]
    return {
        "serviceType": "ClusterIP",
        # No CPUs for tasks: the driver and Ray Train's controller (num_cpus=0) run here, training work on workers.
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0", "num-gpus": "0"},
        "template": {
            "metadata": {"labels": dict(MANAGED_BY)},
            "spec": {
                "terminationGracePeriodSeconds": stop_hooks.grace_period_s(stop_wait_seconds(spec)),
                "nodeSelector": dict(SYSTEM_LABELS),
                **head_affinity(spec),
                **service_account(spec),
                **NO_API_TOKEN,
                "containers": [container],
                "volumes": volumes,
            },
        },
    }


def head_affinity(spec: ClusterSpec) -> dict[str, Any]:
    """The head on a node in the workers' AZs (render.eksctl.head_zones), not across an AZ boundary from them."""
    zones = head_zones(spec)
    if not zones:
        return {}
    term = {"matchExpressions": [{"key": ZONE_LABEL, "operator": "In", "values": zones}]}
    return {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [term]}}}}


def toleration(t: Taint) -> dict[str, str]:
    """The toleration of a worker group's taint (any value when the taint has none)."""
    if t.value:
        return {"key": t.key, "operator": "Equal", "value": t.value, "effect": t.effect}
    return {"key": t.key, "operator": "Exists", "effect": t.effect}


def tolerations(w: WorkerGroup) -> list[dict[str, str]]:
    return [toleration(t) for t in w.taints]


def worker_group(spec: ClusterSpec, w: WorkerGroup, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """`annotations`: the pod template's (the scheduler's placement request), if any."""
    profile = w.profile
    cpu, gib = pod_size(profile, WORKER_RESERVE)
    hugepages = profile.efa_hugepages_mib if spec.fabric == "efa" else 0
    left = fit.room(spec, w.instance_type, False, spec.fabric == "efa", hugepages)  # at most what the node allows
    cpu, gib = max(1, min(cpu, left.cpu_m // 1000)), max(1, min(gib, left.mem_mib // 1024))
    gpus = w.gpus_per_worker
    amounts = {"cpu": str(cpu), "memory": f"{gib}Gi", GPU_RESOURCE: str(gpus)}
    if spec.fabric == "efa":
        amounts[EFA_RESOURCE] = str(profile.efa_interfaces)
        # Without a hugepages request the container's hugetlb limit is 0 and libfabric falls back to 4 KiB pages.
        if profile.efa_hugepages_mib:
            amounts[HUGEPAGES_RESOURCE] = f"{profile.efa_hugepages_mib}Mi"
    volumes, mounts = _volumes(spec, max(1, gib // SHM_SHARE))
    env = fabric_env(spec)
    if staging_gib(profile):
        amounts[EPHEMERAL_RESOURCE] = f"{ephemeral_gib(profile)}Gi"
        volumes.append({"name": "staging", "emptyDir": {"sizeLimit": f"{staging_gib(profile)}Gi"}})
        mounts.append({"name": "staging", "mountPath": STAGING_PATH})
        env = {**env, STAGING_ENV: STAGING_PATH}
    env = {**env, "RAY_JOB_STOP_WAIT_TIME_S": str(stop_wait_seconds(spec))}  # how long its preStop waits
    container = _container(spec, "ray-worker", _env(env, spec), amounts, mounts, stop_hooks.WORKER_WAIT)
    # Locked (pinned) memory for EFA and NCCL buffers: the one capability a worker keeps.
    container["securityContext"] = security_context("IPC_LOCK")
    pod: dict[str, Any] = {"terminationGracePeriodSeconds": stop_hooks.grace_period_s(stop_wait_seconds(spec)),
                           "nodeSelector": {"role": WORKER_ROLE, WORKER_GROUP_LABEL: w.name}}
    if w.taints:
        pod["tolerations"] = tolerations(w)
    pod.update(service_account(spec))
    pod.update(NO_API_TOKEN)
    pod["containers"] = [container]
    pod["volumes"] = volumes
    metadata: dict[str, Any] = {"labels": dict(MANAGED_BY)}
    if annotations:
        metadata["annotations"] = dict(annotations)
    return {
        "groupName": w.name,
        "replicas": w.count,
        "minReplicas": w.count,
        "maxReplicas": w.count,
        "rayStartParams": {"num-gpus": str(gpus)},
        "template": {"metadata": metadata, "spec": pod},
    }


def raycluster_spec(spec: ClusterSpec, placement: Callable[[WorkerGroup], dict[str, str]] | None = None
                    ) -> dict[str, Any]:
    """`placement`: a worker group's pod-template annotations (render.queues.placement_annotations)."""
    return {
        "rayVersion": spec.ray_version,
        "authOptions": {"mode": "token"},
        "enableInTreeAutoscaling": False,
        "headGroupSpec": head_group(spec),
        "workerGroupSpecs": [worker_group(spec, w, placement(w) if placement else None) for w in spec.workers],
    }


def render_raycluster(spec: ClusterSpec, labels: dict[str, str] | None = None,
                      placement: Callable[[WorkerGroup], dict[str, str]] | None = None) -> dict[str, Any]:
    """`labels`: the scheduler's queue label, if any (a queued RayCluster holds its quota while it exists)."""
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": spec.name, "namespace": spec.namespace, "labels": {**MANAGED_BY, **(labels or {})}},
        "spec": raycluster_spec(spec, placement),
    }
