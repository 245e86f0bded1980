"""The hardware catalog: complete, sourced, and in agreement with EC2's DescribeInstanceTypes data."""

from __future__ import annotations

import re

import pytest

from trainlift import catalog
from trainlift.errors import SpecError

REQUIRED_GPU_TYPES = [
    "g5.12xlarge", "g5.48xlarge", "g6.12xlarge", "g6.48xlarge", "g6e.12xlarge", "g6e.48xlarge",
    "p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge", "p5e.48xlarge", "p5en.48xlarge", "p6-b200.48xlarge",
]
GPU_FIGURES = ["gpu_model", "gpus", "gpu_memory_mib", "vcpus", "memory_mib", "network_gbps",
               "efa_interfaces", "gpudirect_rdma", "peak_bf16_flops_per_gpu", "busbw_floor_gbps"]


def test_required_types_are_in_the_catalog():
    assert set(REQUIRED_GPU_TYPES) <= set(catalog.instance_types(gpu=True))
    assert "m7i.xlarge" in catalog.instance_types(gpu=False)


@pytest.mark.parametrize("name", catalog.instance_types(gpu=True))
def test_every_gpu_figure_names_its_source(name):
    profile = catalog.lookup(name)
    for figure in GPU_FIGURES:
        assert profile.sources.get(figure, "").strip(), f"{name}.{figure} has no source"
    assert profile.peak_bf16_flops_per_gpu > 1e13
    assert profile.busbw_floor_gbps and profile.busbw_floor_gbps > 0


def _gbps(performance: str) -> tuple[float, bool]:
    """EC2's NetworkPerformance text ('4x 100 Gigabit', 'Up to 12.5 Gigabit') as (Gb/s, burst)."""
    match = re.fullmatch(r"(Up to )?(?:(\d+)x )?([\d.]+) Gigabit", performance)
    assert match, performance
    return float(match.group(3)) * int(match.group(2) or 1), bool(match.group(1))


@pytest.fixture(scope="module")
def ec2_instance_types():
    boto3 = pytest.importorskip("boto3")
    moto = pytest.importorskip("moto")
    with moto.mock_aws():
        client = boto3.client("ec2", region_name="us-east-2")
        pages = client.get_paginator("describe_instance_types").paginate(
            InstanceTypes=catalog.instance_types()
        )
        return {t["InstanceType"]: t for page in pages for t in page["InstanceTypes"]}


@pytest.mark.parametrize("name", catalog.instance_types())
def test_catalog_matches_ec2_describe_instance_types(name, ec2_instance_types):
    ec2 = ec2_instance_types[name]
    profile = catalog.lookup(name)
    assert profile.vcpus == ec2["VCpuInfo"]["DefaultVCpus"]
    assert profile.memory_mib == ec2["MemoryInfo"]["SizeInMiB"]
    network = ec2["NetworkInfo"]
    efa = network["EfaInfo"]["MaximumEfaInterfaces"] if network.get("EfaSupported") else 0
    assert profile.efa_interfaces == efa
    assert (profile.network_gbps, profile.network_burst) == _gbps(network["NetworkPerformance"])
    storage = ec2.get("InstanceStorageInfo", {}).get("TotalSizeInGB", 0) if ec2.get("InstanceStorageSupported") else 0
    assert profile.local_nvme_gb == storage
    gpus = ec2.get("GpuInfo", {}).get("Gpus", [])
    if not gpus:
        assert profile.gpus == 0 and profile.gpu_model is None
        return
    (gpu,) = gpus
    assert (profile.gpu_model, profile.gpus, profile.gpu_memory_mib) == (
        gpu["Name"], gpu["Count"], gpu["MemoryInfo"]["SizeInMiB"]
    )


def test_efa_interfaces_and_gpudirect():
    assert (catalog.lookup("p5.48xlarge").efa_interfaces, catalog.lookup("p5.48xlarge").gpus) == (32, 8)
    assert (catalog.lookup("g6.12xlarge").efa_interfaces, catalog.lookup("g6.12xlarge").gpus) == (1, 4)
    assert catalog.lookup("p5en.48xlarge").efa_interfaces == 16
    assert catalog.lookup("p4d.24xlarge").gpudirect_rdma
    assert not catalog.lookup("g6.12xlarge").gpudirect_rdma
    assert not catalog.lookup("g6.4xlarge").efa_supported


def test_peaks_follow_the_datasheets():
    assert catalog.lookup("g6.12xlarge").peak_bf16_flops_per_gpu == 121e12
    assert catalog.lookup("p4d.24xlarge").peak_bf16_flops_per_gpu == 312e12
    assert catalog.lookup("p5.48xlarge").peak_bf16_flops_per_gpu == 989e12
    assert catalog.lookup("p5e.48xlarge").peak_bf16_flops_per_gpu == 989e12
    assert catalog.lookup("p6-b200.48xlarge").peak_bf16_flops_per_gpu == 2250e12


@pytest.mark.parametrize(
    "device, peak",
    [
        ("NVIDIA H200", 989e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40S", 362.05e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100-SXM4-40GB", 312e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA A10G", 125e12),
        ("NVIDIA B200", 2250e12),
        ("Tesla T4", None),
        ("NVIDIA GeForce RTX 4090", None),
        ("", None),
    ],
)
def test_peak_flops_for_device_name(device, peak):
    assert catalog.peak_flops_for_device_name(device) == peak


def test_unknown_instance_type_names_the_known_ones():
    with pytest.raises(SpecError) as info:
        catalog.lookup("p9.huge")
    assert "p9.huge" in info.value.message
    assert "g6.12xlarge" in (info.value.hint or "") and "p5.48xlarge" in (info.value.hint or "")


def test_profiles_are_frozen():
    with pytest.raises(Exception):
        catalog.lookup("p5.48xlarge").gpus = 4  # type: ignore[misc]


def test_chart_pins_and_image():
    assert catalog.chart("kuberay-operator").version == "1.7.0"
    assert catalog.chart("nvidia-device-plugin").repo == "https://nvidia.github.io/k8s-device-plugin"
    assert catalog.chart("aws-efa-k8s-device-plugin").version == "v0.5.32"
    assert catalog.image_ray_version("public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1") == "2.58.0"
    assert catalog.image_ray_version("example.com/unknown:latest") is None


def test_every_gpu_type_has_local_nvme_for_the_staging_volume():
    """The rendered worker pods stage checkpoints on the node's instance-store NVMe (render.raycluster), never on the
    root disk: every GPU type in the catalog must have one."""
    gpu_types = [t for t in catalog.instance_types() if catalog.lookup(t).gpus]
    assert gpu_types and all(catalog.lookup(t).local_nvme_gb > 0 for t in gpu_types)
