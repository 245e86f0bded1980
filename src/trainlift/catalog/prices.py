"""On-demand prices from the packaged table (prices.yaml), each with its source and the day it was checked."""

from __future__ import annotations

from datetime import date
from functools import lru_cache
from importlib import resources
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field


class Price(BaseModel):
    """USD per instance-hour, on demand, Linux, shared tenancy, for one instance type in one region."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    instance_type: str
    region: str
    usd_per_hour: float = Field(gt=0)
    source: str = Field(description="The source's key in prices.yaml, or aws-price-list-api for a live price.")
    as_of: date = Field(description="The day the figure was checked against its source.")

    def to_dict(self) -> dict[str, Any]:
        return {**self.model_dump(), "as_of": self.as_of.isoformat()}


PRICE_REGION = "us-east-1"  # where `price` and `estimate` look prices up when no region is configured


@lru_cache(maxsize=1)
def _table() -> dict[str, Any]:
    return yaml.safe_load(resources.files("trainlift.catalog").joinpath("prices.yaml").read_text())


@lru_cache(maxsize=None)
def on_demand_price(instance_type: str, region: str) -> Price | None:
    """The catalog's on-demand price of a type in a region; None when the catalog has no such row."""
    row = (_table()["prices"].get(region) or {}).get(instance_type)
    if row is None:
        return None
    return Price(instance_type=instance_type, region=region, **row)


def price_regions() -> list[str]:
    """Regions the catalog has prices for, sorted."""
    return sorted(_table()["prices"])


def price_sources() -> dict[str, str]:
    """Source key -> what the source is, where it says what it says."""
    return dict(_table()["sources"])
