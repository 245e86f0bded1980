"""ClusterSpec -> eksctl ClusterConfig: the cluster, its add-ons and every node group in one file."""

from __future__ import annotations

from typing import Any, Mapping

import yaml

from trainlift import catalog
from trainlift.cloud.capacity import Reservation, Unknown
from trainlift.config.cluster import ClusterSpec, WorkerGroup
from trainlift.render.image_cache import node_policy
from trainlift.render.s3_access import s3_policy

SYSTEM_GROUP = "system-nodes"
SYSTEM_LABELS = {"role": "system"}
WORKER_ROLE = "gpu-worker"
WORKER_GROUP_LABEL = "trainlift.io/worker-group"
GPU_PRESENT_LABEL = "nvidia.com/gpu.present"
RESERVED_LABELS = ("role", GPU_PRESENT_LABEL, WORKER_GROUP_LABEL)
Reservations = Mapping[str, Reservation | Unknown]  # capacity reservation id -> what EC2 says about it


def worker_labels(w: WorkerGroup) -> dict[str, str]:
    # The NVIDIA device plugin chart's default affinity needs nvidia.com/gpu.present
    # (or Node Feature Discovery, which this cluster does not run).
    return {"role": WORKER_ROLE, GPU_PRESENT_LABEL: "true", WORKER_GROUP_LABEL: w.name, **w.labels}


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
    configured = names.get("configuration", {})
    addons: list[dict[str, Any]] = [{"name": n, **({"configurationValues": configured[n]} if n in configured else {})}
                                    for n in names["core"]]
    if spec.storage and spec.storage.fsx:
        for name in names["fsx"]:
            addon: dict[str, Any] = {"name": name}
            if name == "aws-fsx-csi-driver":
                addon["useDefaultPodIdentityAssociations"] = True
            addons.append(addon)
    return addons


def _sized(count: int) -> dict[str, int]:
    return {"desiredCapacity": count, "minSize": count, "maxSize": count}


def block_active(w: WorkerGroup, reservations: Reservations | None) -> bool:
    """Whether the group's Capacity Block is known to be active (launches before then fail)."""
    found = (reservations or {}).get(w.capacity_reservation_id or "")
    return isinstance(found, Reservation) and found.state == "active"


def _worker_size(w: WorkerGroup, reservations: Reservations | None) -> dict[str, int]:
    if not w.capacity_block:
        return _sized(w.count)
    # Zero nodes until the block starts; min 0 so the group can drain before EC2 ends the block.
    return {"desiredCapacity": w.count if block_active(w, reservations) else 0, "minSize": 0, "maxSize": w.count}


# Pods get no instance metadata (IMDSv2 required, hop limit 1: eksctl pkg/cfn/builder/nodegroup.go@v0.230.0,
# makeMetadataOptions), so none can take the node role's credentials. Nothing trainlift runs on the nodes needs it:
# the Ray pods reach S3 through IRSA (the role of storage.s3.service_account), with AWS_REGION set by EKS's pod
# identity webhook; the FSx CSI driver gets its role through EKS Pod Identity and reads instance facts from the
# Kubernetes API without IMDS (aws-fsx-csi-driver pkg/cloud/metadata.go); the VPC CNI, kube-proxy and the EFA device
# plugin use host networking, which the hop limit does not touch.
NO_POD_IMDS = {"disablePodIMDS": True}


def head_zones(spec: ClusterSpec) -> list[str]:
    """The AZs of the system group and the Ray head: the workers', so the head and every worker talk within them;
    empty (any of the cluster's AZs) while a worker group is not pinned to an AZ (`cluster up` pins each to the AZ its
    capacity check chose before it renders)."""
    zones: list[str] = []
    for w in spec.workers:
        if not w.availability_zones:
            return []
        zones += [z for z in w.availability_zones if z not in zones]
    return zones


def _system_group(spec: ClusterSpec) -> dict[str, Any]:
    profile = catalog.lookup(spec.system.instance_type)
    zones = head_zones(spec)
    return {
        "name": SYSTEM_GROUP,
        "instanceType": spec.system.instance_type,
        "amiFamily": spec.ami_family,
        **_sized(spec.system.count),
        **({"availabilityZones": zones} if zones else {}),
        "privateNetworking": True,
        **_volume(spec, spec.system.volume_size_gb, profile),
        **NO_POD_IMDS,
        **_bootstrap(spec, profile),
        "labels": dict(SYSTEM_LABELS),
    }


# nodeadm (AL2023) RAIDs the instance-store NVMe disks into one array and moves kubelet's, containerd's and the SOCI
# snapshotter's directories onto it, so pods' emptyDir volumes (the staging volume) and image layers live on the NVMe
# (amazon-eks-ami templates/al2023/runtime/bin/setup-local-disks; SOCI's directory since v20251217). Its FastImagePull
# feature gate (AMIs from v20250813) switches containerd to the SOCI snapshotter in parallel pull-and-unpack mode:
# 16 MiB chunks, 20 downloads and 12 unpacks at a time per image (nodeadm internal/containerd/snapshotter), ignored
# below 4 vCPUs or 7 GiB. eksctl accepts a NodeConfig in overrideBootstrapCommand for AL2023 managed groups without a
# custom AMI, and EKS adds the cluster's own part (eksctl validation.go, PR #8078).
NODE_CONFIG = {"apiVersion": "node.eks.aws/v1alpha1", "kind": "NodeConfig"}
PARALLEL_PULL_MIN_VCPUS, PARALLEL_PULL_MIN_MIB = 4, 7 * 1024  # nodeadm's UseSOCISnapshotter
# Without instance store the layers are written to the root volume: nodeadm asks for at least 600 MiB/s of it for a
# parallel pull (nodeadm doc/examples.md, "Enabling fast image pull"); gp3's 3,000 baseline IOPS allow that.
PARALLEL_PULL_THROUGHPUT = 600


def pulls_in_parallel(spec: ClusterSpec, profile: catalog.InstanceProfile) -> bool:
    """Whether the group's nodes pull images with SOCI's parallel mode (nodeadm ignores the gate on small nodes)."""
    return spec.image.parallel_pull and profile.vcpus >= PARALLEL_PULL_MIN_VCPUS \
        and profile.memory_mib >= PARALLEL_PULL_MIN_MIB


def image_pulls(spec: ClusterSpec) -> dict[str, str]:
    """How each node group's nodes pull the image, by group name (what `render` and `cluster up` print)."""
    groups = [(SYSTEM_GROUP, spec.system.instance_type)] + [(w.name, w.instance_type) for w in spec.workers]
    pulls = {}
    for name, instance_type in groups:
        profile = catalog.lookup(instance_type)
        where = ("layers on the instance-store RAID0" if profile.local_nvme_gb
                 else f"layers on a gp3 root volume at {PARALLEL_PULL_THROUGHPUT} MiB/s")
        how = (f"parallel (SOCI pull-and-unpack, nodeadm FastImagePull), {where}" if pulls_in_parallel(spec, profile)
               else "sequential (image.parallel_pull: false)" if not spec.image.parallel_pull
               else f"sequential ({profile.vcpus} vCPUs, {profile.memory_gib:g} GiB: below nodeadm's "
                    f"{PARALLEL_PULL_MIN_VCPUS} vCPUs and {PARALLEL_PULL_MIN_MIB // 1024} GiB for a parallel pull)")
        pulls[name] = f"{name} ({instance_type}): {how}"
    return pulls


def _bootstrap(spec: ClusterSpec, profile: catalog.InstanceProfile) -> dict[str, str]:
    node: dict[str, Any] = {}
    if profile.local_nvme_gb:
        node["instance"] = {"localStorage": {"strategy": "RAID0"}}
    if pulls_in_parallel(spec, profile):
        node["featureGates"] = {"FastImagePull": True}
    if not node:
        return {}
    return {"overrideBootstrapCommand": yaml.safe_dump({**NODE_CONFIG, "spec": node}, sort_keys=False)}


def _volume(spec: ClusterSpec, size_gb: int, profile: catalog.InstanceProfile) -> dict[str, Any]:
    volume: dict[str, Any] = {"volumeSize": size_gb}
    if pulls_in_parallel(spec, profile) and not profile.local_nvme_gb:
        volume.update({"volumeType": "gp3", "volumeThroughput": PARALLEL_PULL_THROUGHPUT})
    return volume


def _worker_group(spec: ClusterSpec, w: WorkerGroup, reservations: Reservations | None) -> dict[str, Any]:
    efa = spec.fabric == "efa"
    group: dict[str, Any] = {
        "name": w.name,
        "instanceType": w.instance_type,
        "amiFamily": spec.ami_family,
        **_worker_size(w, reservations),
    }
    if w.availability_zones:
        group["availabilityZones"] = list(w.availability_zones)
    group["privateNetworking"] = True
    group["efaEnabled"] = efa
    group.update(_volume(spec, w.volume_size_gb, w.profile))
    group.update(NO_POD_IMDS)
    group.update(_bootstrap(spec, w.profile))
    group["labels"] = worker_labels(w)
    if w.taints:
        group["taints"] = [{"key": t.key, "value": t.value, "effect": t.effect} for t in w.taints]
    if w.placement_group:
        group["placement"] = {"groupName": w.placement_group}
    if w.capacity_reservation_id:
        group["capacityReservation"] = {
            "capacityReservationTarget": {"capacityReservationID": w.capacity_reservation_id}
        }
    if w.capacity_block:
        group["instanceMarketOptions"] = {"marketType": "capacity-block"}
    return group


# eksctl puts metadata.tags on the EKS cluster and on every CloudFormation stack it creates: `cluster up` adopts, and
# `cluster down` deletes, only what carries this tag with the cluster's name.
OWNER_TAG = "trainlift.io/cluster"


def with_caller_address(spec: ClusterSpec, cidr: str | None) -> ClusterSpec:
    """The spec `cluster up` renders: with no api_access_cidrs of its own, only the caller's address (`cidr`, its
    public address as a /32, looked up by cloud.caller) reaches the EKS API's public endpoint."""
    if spec.api_access_cidrs or not cidr:
        return spec
    return spec.model_copy(update={"api_access_cidrs": [cidr]})


def open_endpoint_note(spec: ClusterSpec) -> str:
    """What eksctl.yaml's header says when no address limits the public endpoint ("" when one does)."""
    if spec.api_access_cidrs:
        return ""
    return ("vpc.publicAccessCIDRs: none known at render time, so the EKS API endpoint is open to every address; "
            "`trainlift cluster up` limits it to this machine's public address, or set api_access_cidrs in the "
            "cluster spec")


def render_eksctl(spec: ClusterSpec, reservations: Reservations | None = None) -> dict[str, Any]:
    """`reservations` (id -> facts from EC2) size Capacity Block groups; unknown blocks start at 0 nodes. The owner
    tag is in every render, so a cluster created from `render -o` is one `cluster down` recognizes."""
    config: dict[str, Any] = {
        "apiVersion": "eksctl.io/v1alpha5",
        "kind": "ClusterConfig",
        "metadata": {"name": spec.name, "region": spec.region, "version": spec.kubernetes_version,
                     "tags": {OWNER_TAG: spec.name}},
    }
    if spec.availability_zones:
        config["availabilityZones"] = list(spec.availability_zones)
    config["vpc"] = {"clusterEndpoints": {"privateAccess": True, "publicAccess": True}}
    if spec.api_access_cidrs:  # else EKS's default: every address (render says so in eksctl.yaml's header)
        config["vpc"]["publicAccessCIDRs"] = list(spec.api_access_cidrs)
    config["iam"] = _iam(spec)
    config["addons"] = _addons(spec)
    groups = [_system_group(spec)] + [_worker_group(spec, w, reservations) for w in spec.workers]
    if (policy := node_policy(spec)) is not None:
        for group in groups:
            group["iam"] = {"attachPolicy": policy}
    config["managedNodeGroups"] = groups
    return config
