"""ClusterSpec -> eksctl ClusterConfig: the cluster, its add-ons and every node group in one file."""

from __future__ import annotations

from typing import Any

from trainlift import catalog
from trainlift.config.cluster import ClusterSpec, S3Storage, WorkerGroup

SYSTEM_GROUP = "system-nodes"
SYSTEM_LABELS = {"role": "system"}
WORKER_ROLE = "gpu-worker"
WORKER_GROUP_LABEL = "trainlift.io/worker-group"
GPU_PRESENT_LABEL = "nvidia.com/gpu.present"
RESERVED_LABELS = ("role", GPU_PRESENT_LABEL, WORKER_GROUP_LABEL)


def worker_labels(w: WorkerGroup) -> dict[str, str]:
    # The NVIDIA device plugin chart's default affinity needs nvidia.com/gpu.present
    # (or Node Feature Discovery, which this cluster does not run).
    return {"role": WORKER_ROLE, GPU_PRESENT_LABEL: "true", WORKER_GROUP_LABEL: w.name, **w.labels}


def _partition(region: str) -> str:
    if region.startswith("cn-"):
        return "aws-cn"
    return "aws-us-gov" if region.startswith("us-gov-") else "aws"


def s3_policy(s3: S3Storage, region: str) -> dict[str, Any]:
    """Least privilege for checkpoints: list, read, write and delete under the storage prefix only."""
    bucket = f"arn:{_partition(region)}:s3:::{s3.bucket}"
    objects = f"{bucket}/{s3.prefix}/*" if s3.prefix else f"{bucket}/*"
    listing: dict[str, Any] = {"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": bucket}
    if s3.prefix:
        listing["Condition"] = {"StringLike": {"s3:prefix": [s3.prefix, f"{s3.prefix}/*"]}}
    return {
        "Version": "2012-10-17",
        "Statement": [
            {"Effect": "Allow", "Action": ["s3:GetBucketLocation"], "Resource": bucket},
            listing,
            {
                "Effect": "Allow",
                "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"],
                "Resource": objects,
            },
        ],
    }


def _iam(spec: ClusterSpec) -> dict[str, Any]:
    iam: dict[str, Any] = {"withOIDC": True}
    s3 = spec.storage.s3 if spec.storage else None
    if s3 is not None and s3.role_arn is None:
        iam["serviceAccounts"] = [{
            "metadata": {"name": s3.service_account, "namespace": spec.namespace},
            "attachPolicy": s3_policy(s3, spec.region),
        }]
    return iam


def _addons(spec: ClusterSpec) -> list[dict[str, Any]]:
    names = catalog.platform()["eks_addons"]
    addons: list[dict[str, Any]] = [{"name": n} for n in names["core"]]
    if spec.storage and spec.storage.fsx:
        for name in names["fsx"]:
            addon: dict[str, Any] = {"name": name}
            if name == "aws-fsx-csi-driver":
                addon["useDefaultPodIdentityAssociations"] = True
            addons.append(addon)
    return addons


def _sized(count: int) -> dict[str, int]:
    return {"desiredCapacity": count, "minSize": count, "maxSize": count}


def _system_group(spec: ClusterSpec) -> dict[str, Any]:
    return {
        "name": SYSTEM_GROUP,
        "instanceType": spec.system.instance_type,
        "amiFamily": spec.ami_family,
        **_sized(spec.system.count),
        "privateNetworking": True,
        "volumeSize": spec.system.volume_size_gb,
        "labels": dict(SYSTEM_LABELS),
    }


def _worker_group(spec: ClusterSpec, w: WorkerGroup) -> dict[str, Any]:
    efa = spec.fabric == "efa"
    group: dict[str, Any] = {
        "name": w.name,
        "instanceType": w.instance_type,
        "amiFamily": spec.ami_family,
        **_sized(w.count),
    }
    if w.availability_zones:
        group["availabilityZones"] = list(w.availability_zones)
    group["privateNetworking"] = True
    group["efaEnabled"] = efa
    group["volumeSize"] = w.volume_size_gb
    group["labels"] = worker_labels(w)
    if w.taints:
        group["taints"] = [{"key": t.key, "value": t.value, "effect": t.effect} for t in w.taints]
    if w.placement_group:
        group["placement"] = {"groupName": w.placement_group}
    if w.capacity_reservation_id:
        group["capacityReservation"] = {
            "capacityReservationTarget": {"capacityReservationID": w.capacity_reservation_id}
        }
    return group


def render_eksctl(spec: ClusterSpec) -> dict[str, Any]:
    config: dict[str, Any] = {
        "apiVersion": "eksctl.io/v1alpha5",
        "kind": "ClusterConfig",
        "metadata": {"name": spec.name, "region": spec.region, "version": spec.kubernetes_version},
    }
    if spec.availability_zones:
        config["availabilityZones"] = list(spec.availability_zones)
    config["vpc"] = {"clusterEndpoints": {"privateAccess": True, "publicAccess": True}}
    config["iam"] = _iam(spec)
    config["addons"] = _addons(spec)
    config["managedNodeGroups"] = [_system_group(spec)] + [_worker_group(spec, w) for w in spec.workers]
    return config
