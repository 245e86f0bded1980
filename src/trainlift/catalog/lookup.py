"""Read the packaged catalog data: instance profiles, GPU peaks, software pins."""

from __future__ import annotations

import re
from functools import lru_cache
from importlib import resources
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from trainlift.errors import SpecError


class InstanceProfile(BaseModel):
    """What one EC2 instance type offers a Ray worker. CPU types have gpus == 0."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    instance_type: str
    gpu_model: str | None = None
    gpus: int = 0
    gpu_memory_mib: int = 0
    vcpus: int
    memory_mib: int
    network_gbps: float = Field(description="Network bandwidth in Gb/s (the peak when network_burst).")
    network_burst: bool = Field(False, description="EC2 lists the bandwidth as 'Up to ...'.")
    efa_interfaces: int = Field(0, description="EFA interfaces the instance takes; 0 when it has no EFA.")
    efa_hugepages_mib: int = Field(0, description="2 MiB hugepages (in MiB) an EFA pod requests; 0 without EFA.")
    max_pods: int = Field(110, description="The kubelet's maxPods on an EKS AL2023 node of this type (nodeadm).")
    gpudirect_rdma: bool = False
    network_layers: int = Field(
        0, description="Layers of EC2 network topology EKS labels the node with (topology.k8s.aws/network-node-layer-N); "
        "0: none.")
    local_nvme_gb: int = Field(0, description="Instance-store NVMe, GB in all (EC2's TotalSizeInGB); 0: none.")
    peak_bf16_flops_per_gpu: float = Field(0.0, description="Dense bf16 tensor peak, FLOP/s.")
    busbw_floor_gbps: float | None = Field(
        None, description="GB/s (gigabytes, as nccl-tests prints busbw): a 2-node all_reduce busbw below this fails the fabric check."
    )
    sources: dict[str, str] = Field(default_factory=dict, description="Field name -> where the figure comes from.")

    @property
    def efa_supported(self) -> bool:
        return self.efa_interfaces > 0

    @property
    def memory_gib(self) -> float:
        return self.memory_mib / 1024


class ChartPin(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    chart: str
    repo: str
    version: str
    namespace: str
    source: str
    digests: dict[str, str] = {}  # version -> sha256:<hex> of its .tgz
    digest_source: str = ""


def load_data(name: str) -> dict[str, Any]:
    return yaml.safe_load(resources.files("trainlift.catalog").joinpath(name).read_text())


@lru_cache(maxsize=1)
def _instances() -> dict[str, InstanceProfile]:
    data = load_data("instances.yaml")
    texts, models = data["sources"], data["gpu_models"]
    profiles = {}
    for name, entry in data["instances"].items():
        entry = dict(entry)
        overrides = entry.pop("sources", {})
        fields = {**data["field_sources"], **overrides}
        sources = {field: texts[key] for field, key in fields.items() if field in entry}
        model = entry.get("gpu_model")
        if model:
            entry["peak_bf16_flops_per_gpu"] = float(models[model]["peak_bf16_tflops"]) * 1e12
            sources["peak_bf16_flops_per_gpu"] = texts[models[model]["source"]]
        profiles[name] = InstanceProfile(instance_type=name, sources=sources, **entry)
    return profiles


@lru_cache(maxsize=1)
def _device_peaks() -> list[tuple[list[str], float]]:
    data = load_data("instances.yaml")
    entries = list(data["device_variants"]) + list(data["gpu_models"].values())
    return [
        ([d.upper().split() for d in e["devices"]], float(e["peak_bf16_tflops"]) * 1e12)
        for e in entries
    ]


@lru_cache(maxsize=1)
def platform() -> dict[str, Any]:
    """Software pins and platform facts (platform.yaml), sources included."""
    return load_data("platform.yaml")


def instance_types(*, gpu: bool | None = None) -> list[str]:
    """Known instance types, sorted; gpu=True/False keeps only GPU or only CPU types."""
    return sorted(
        name for name, p in _instances().items() if gpu is None or (p.gpus > 0) == gpu
    )


def lookup(instance_type: str) -> InstanceProfile:
    """The catalog's profile of an instance type; SpecError naming the known types otherwise."""
    try:
        return _instances()[instance_type]
    except KeyError:
        raise SpecError(
            f"instance type {instance_type!r} is not in the hardware catalog",
            hint="known: " + ", ".join(instance_types()),
        ) from None


def peak_flops_for_device_name(name: str) -> float | None:
    """Dense bf16 peak FLOP/s for a torch.cuda.get_device_name() string; None when unknown."""
    words = re.split(r"[\s\-_]+", name.upper().strip())
    if words and words[0] == "NVIDIA":
        words = words[1:]
    for patterns, peak in _device_peaks():
        for pattern in patterns:
            n = len(pattern)
            if any(words[i : i + n] == pattern for i in range(len(words) - n + 1)):
                return peak
    return None


def chart(name: str) -> ChartPin:
    entry = dict(platform()["charts"][name])
    entry["source"] = platform()["sources"][entry["source"]]
    if entry.get("digest_source"):
        entry["digest_source"] = platform()["sources"][entry["digest_source"]]
    entry["digests"] = {str(version): digest for version, digest in entry.get("digests", {}).items()}
    return ChartPin(**entry)


def image_entry(image: str) -> dict[str, Any] | None:
    # `name:tag@sha256:...` is the tagged image pinned to one digest.
    return platform()["images"].get(image.split("@", 1)[0])


def image_ray_version(image: str) -> str | None:
    """The Ray version inside a known container image; None for an image the catalog doesn't know."""
    entry = image_entry(image)
    return str(entry["ray_version"]) if entry else None


def pinned_image(image: str) -> str | None:
    """The release tag a floating tag stands for now (the image itself when its tag is a release); None when unknown."""
    if "@" in image:
        return None
    entry = image_entry(image)
    if entry is None:
        return None
    return str(entry.get("pinned", image))
