"""Hardware profiles, on-demand prices and software pins as data (instances.yaml, prices.yaml, platform.yaml),
with their sources."""

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
from trainlift.catalog.prices import Price, on_demand_price, price_regions, price_sources

__all__ = [
    "ChartPin",
    "InstanceProfile",
    "Price",
    "chart",
    "image_ray_version",
    "instance_types",
    "lookup",
    "on_demand_price",
    "peak_flops_for_device_name",
    "platform",
    "price_regions",
    "price_sources",
]
