"""Hardware profiles and software pins as data (instances.yaml, platform.yaml), with their sources."""

from trainlift.catalog.lookup import (
    ChartPin,
    InstanceProfile,
    chart,
    image_ray_version,
    instance_types,
    lookup,
    peak_flops_for_device_name,
    platform,
)

__all__ = [
    "ChartPin",
    "InstanceProfile",
    "chart",
    "image_ray_version",
    "instance_types",
    "lookup",
    "peak_flops_for_device_name",
    "platform",
]
