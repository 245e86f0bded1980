"""The cluster spec: one typed description of the EKS cluster, its node groups and the Ray cluster on it.

Defaults are the reference deployment's pins (catalog/platform.yaml). Unknown keys
are errors; errors name the field path, e.g. `workers[0].instance_type: ...`.
Cross-field rules (EFA and AZs, GPU counts, Ray versions, inline secrets) live in
`trainlift.render.rules` and run before anything is rendered.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from trainlift import catalog
from trainlift.config.errors import first_error
from trainlift.errors import SpecError

DNS_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
S3_URI = r"^s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/.*)?$"
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"

_defaults = catalog.platform()["defaults"]


def _chart_version(name: str) -> str:
    return catalog.chart(name).version


def _known_type(value: str, *, gpu: bool | None = None) -> str:
    known = catalog.instance_types(gpu=gpu)
    if value not in known:
        kind = {True: "GPU ", False: "CPU "}.get(gpu, "")
        if value in catalog.instance_types():
            raise ValueError(f"{value} is not a {kind}instance type; {kind}types: {', '.join(known)}")
        raise ValueError(f"{value!r} is not in the hardware catalog; known {kind}types: {', '.join(known)}")
    return value


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Taint(_Section):
    key: str = Field(min_length=1)
    value: str = ""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] = "NoSchedule"


class SystemGroup(_Section):
    """CPU nodes for the KubeRay operator and the Ray head."""

    instance_type: str = _defaults["system_instance_type"]
    count: int = Field(1, ge=1)
    volume_size_gb: int = Field(80, ge=20)

    @field_validator("instance_type")
    @classmethod
    def _known(cls, value: str) -> str:
        return _known_type(value)


class WorkerGroup(_Section):
    """GPU nodes; one Ray worker pod per node."""

    name: str = Field("gpu-workers", pattern=DNS_LABEL, max_length=40)
    instance_type: str
    count: int = Field(1, ge=1)
    availability_zones: list[str] = Field(default_factory=list, description="EFA groups need exactly one.")
    gpus: int | None = Field(None, ge=1, description="GPUs per Ray worker; default: all of the instance's.")
    capacity_reservation_id: str | None = Field(None, pattern=r"^cr-[0-9a-f]+$")
    capacity_block: bool = Field(
        False, description="capacity_reservation_id is a Capacity Block for ML: launched with market type "
        "capacity-block; the group has 0 nodes until the block is active.")
    placement_group: str | None = None
    taints: list[Taint] = Field(default_factory=list)
    labels: dict[str, str] = Field(default_factory=dict)
    volume_size_gb: int = Field(200, ge=20)

    @field_validator("instance_type")
    @classmethod
    def _known_gpu(cls, value: str) -> str:
        return _known_type(value, gpu=True)

    @property
    def profile(self) -> catalog.InstanceProfile:
        return catalog.lookup(self.instance_type)

    @property
    def gpus_per_worker(self) -> int:
        return self.gpus if self.gpus is not None else self.profile.gpus


class ImageSpec(_Section):
    uri: str = _defaults["image"]
    ray_version: str | None = Field(None, description="Ray inside the image; known DLC tags fill it in.")
    pull_policy: Literal["IfNotPresent", "Always"] = "IfNotPresent"
    cache: Literal["none", "ecr"] = Field(
        "none", description="ecr: the nodes pull the image through an ECR pull-through cache rule of the cluster's "
        "account and region (`cluster up` creates it): fetched from ECR Public once, then from the region's "
        "private ECR, and pinned by digest from there. none: every node pulls from the image's own registry.")
    account: str | None = Field(None, pattern=r"^\d{12}$", description="The AWS account of the ECR cache; "
                                "`cluster up` and `render` fill it in from the credentials.")
    parallel_pull: bool = Field(
        True, description="Nodes pull images with the SOCI snapshotter's parallel pull-and-unpack mode (nodeadm's "
        "FastImagePull feature gate on the EKS AL2023 AMI): each layer fetched in 16 MiB chunks, 20 downloads and 12 "
        "unpacks at a time. It needs 4 vCPUs and 7 GiB, so smaller nodes pull as before; nodes without instance store "
        "get a gp3 root volume at 600 MiB/s for the layers. false: containerd's sequential pull.")


class S3Storage(_Section):
    uri: str = Field(pattern=S3_URI, description="Checkpoints and run files; the pods' role may read and write here.")
    service_account: str = Field("ray-train", pattern=DNS_LABEL)
    role_arn: str | None = Field(
        None,
        pattern=r"^arn:aws[a-z\-]*:iam::\d{12}:role/.+$",
        description="An existing IRSA role; without it eksctl creates one limited to `uri` and `read`.",
    )
    read: list[Annotated[str, Field(pattern=S3_URI)]] = Field(
        default_factory=list, description="More S3 locations the pods may only read: code zips, datasets, weights.")
    allow_whole_bucket: bool = Field(
        False, description="Let `uri` or a `read` location be a whole bucket (s3://bucket): the pods' role then "
        "reaches every object in it. Off, such a location is refused; name a folder instead.")

    @property
    def bucket(self) -> str:
        return self.uri[len("s3://"):].split("/", 1)[0]

    @property
    def prefix(self) -> str:
        rest = self.uri[len("s3://"):].split("/", 1)
        return rest[1].strip("/") if len(rest) > 1 else ""


class FsxStorage(_Section):
    claim: str = Field(pattern=DNS_LABEL, description="An existing PersistentVolumeClaim bound to FSx for Lustre.")
    mount_path: str = Field("/fsx", pattern=r"^/[^\s]*$")


class Storage(_Section):
    """Where checkpoints go: shared by every node."""

    s3: S3Storage | None = None
    fsx: FsxStorage | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> "Storage":
        if (self.s3 is None) == (self.fsx is None):
            raise ValueError("set exactly one of storage.s3 or storage.fsx")
        return self

    @property
    def path(self) -> str:
        return self.s3.uri if self.s3 else self.fsx.mount_path  # type: ignore[union-attr]


class SecretRef(_Section):
    """An environment variable filled from a Kubernetes Secret the user created."""

    env: str = Field(pattern=ENV_NAME)
    secret: str = Field(pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    key: str = Field(min_length=1)
    optional: bool = Field(False, description="Start the pods even when the Secret does not exist.")
    value: str | None = Field(None, description="Never valid: the rules reject a secret written inline.")


class Versions(_Section):
    kuberay: str = _chart_version("kuberay-operator")
    nvidia_device_plugin: str = _chart_version("nvidia-device-plugin")
    efa_device_plugin: str = _chart_version("aws-efa-k8s-device-plugin")
    kueue: str = _chart_version("kueue")
    volcano: str = _chart_version("volcano")
    chart_digests: dict[Literal["kuberay-operator", "nvidia-device-plugin", "aws-efa-k8s-device-plugin", "kueue",
                                "volcano"], Annotated[str, Field(pattern=r"^sha256:[0-9a-f]{64}$")]] = Field(
        default_factory=dict, description="The sha256 of a chart version's .tgz, by Helm release (e.g. "
        "{kuberay-operator: 'sha256:...'}, from the chart repository's index.yaml): `cluster up` installs only that "
        "file. Default: trainlift's own digest for its pinned version where it has one, else the digest `cluster up` "
        "first installs, recorded in the cluster directory.")


class ClusterSpec(_Section):
    name: str = Field(pattern=DNS_LABEL, max_length=40, description="EKS cluster and RayCluster name.")
    region: str = Field(_defaults["region"], pattern=r"^[a-z]{2}(-[a-z]+)+-\d$")
    kubernetes_version: str = Field(_defaults["kubernetes_version"], pattern=r"^1\.\d+$")
    ami_family: Literal["AmazonLinux2023"] = Field(
        _defaults["ami_family"], description="The EKS AL2023 AMI (its NVIDIA variant on GPU nodes): trainlift "
        "configures nodes through its nodeadm NodeConfig (instance store RAID0, parallel image pull).")
    namespace: str = Field(_defaults["namespace"], pattern=DNS_LABEL, max_length=63)
    availability_zones: list[str] = Field(
        default_factory=list, description="Cluster AZs (EKS needs two); must include every worker group's AZ."
    )
    system: SystemGroup = Field(default_factory=SystemGroup)
    workers: list[WorkerGroup] = Field(min_length=1)
    fabric: Literal["efa", "socket"] | None = Field(
        None, description="Default: efa when every worker instance has EFA, else socket."
    )
    image: ImageSpec = Field(default_factory=ImageSpec)
    ray_version: str | None = Field(None, description="RayCluster rayVersion; default: the image's Ray.")
    storage: Storage | None = None
    secrets: list[SecretRef] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict, description="Plain environment for every Ray pod.")
    versions: Versions = Field(default_factory=Versions)
    scheduler: Literal["none", "kueue", "volcano"] | None = Field(
        None, description="Who queues jobs: Kueue admits a whole RayJob or none of it; volcano gang-schedules; "
        "none: pods go straight to the Kubernetes scheduler. Default: kueue when the cluster has GPU worker groups.")
    api_access_cidrs: list[str] = Field(
        default_factory=list, description="CIDR blocks that may reach the EKS API's public endpoint (eksctl "
        "vpc.publicAccessCIDRs, set when eksctl creates the cluster); nodes use the private endpoint. Empty: "
        "`cluster up` looks up this machine's public address (checkip.amazonaws.com) and allows only that /32; "
        "where no address is known (`render` alone, or a failed lookup) the endpoint is open to every address, and "
        "eksctl.yaml's header and the plan say so.")
    placement: Literal["preferred", "required"] = Field(
        "preferred", description="With Kueue, on instance types EKS labels with their network topology: keep a "
        "worker group under one bottom-layer network node if it fits (preferred) or only then (required).")

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not re.fullmatch(ENV_NAME, name):
                raise ValueError(f"{name!r} is not a valid environment variable name")
        return value

    @field_validator("api_access_cidrs")
    @classmethod
    def _cidrs(cls, value: list[str]) -> list[str]:
        for cidr in value:
            try:
                ipaddress.ip_network(cidr, strict=True)
            except ValueError:
                raise ValueError("not a CIDR block with its host bits zero, e.g. 203.0.113.7/32 or 198.51.100.0/24 "
                                 f"(got {cidr!r})") from None
        return value

    @model_validator(mode="after")
    def _resolve_defaults(self) -> "ClusterSpec":
        if self.fabric is None:
            efa = all(w.profile.efa_supported for w in self.workers)
            self.fabric = "efa" if efa else "socket"
        if self.image.ray_version is None:
            known = catalog.image_ray_version(self.image.uri)
            if known is None:
                raise ValueError(
                    f"image.ray_version: required for {self.image.uri} (the catalog knows the Ray "
                    "version of these images only: " + ", ".join(catalog.platform()["images"]) + ")"
                )
            self.image.ray_version = known
        if self.ray_version is None:
            self.ray_version = self.image.ray_version
        if self.scheduler is None:
            self.scheduler = "kueue" if any(w.profile.gpus for w in self.workers) else "none"
        return self

    @property
    def gpu_count(self) -> int:
        return sum(w.count * w.gpus_per_worker for w in self.workers)


def parse_cluster_spec(data: dict[str, Any], source: str | None = None) -> ClusterSpec:
    """A ClusterSpec from a mapping; SpecError naming the field path on the first problem."""
    prefix = f"{source}: " if source else ""
    if not isinstance(data, dict):
        raise SpecError(f"{prefix}a cluster spec is a mapping with name, workers, ... keys")
    try:
        return ClusterSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(prefix + first_error(exc), hint="see examples/cluster-reference.yaml") from None


def cluster_spec_from_yaml(text: str, source: str | None = None) -> ClusterSpec:
    """Parse the YAML text of a cluster spec (the caller reads the file)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise SpecError(f"{source or 'spec'}{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    return parse_cluster_spec(data, source)
