"""What a cluster spec costs per hour on demand: each node group's count times its type's catalog price, and the
total. Pure: the prices come from the packaged catalog (or a lookup the caller passes), nothing is asked of AWS."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from trainlift import catalog
from trainlift.catalog import Price
from trainlift.config.cluster import ClusterSpec
from trainlift.render.eksctl import SYSTEM_GROUP

PriceLookup = Callable[[str, str], "Price | None"]
_CAPACITY_BLOCK = "a Capacity Block is paid for when bought, at its own rate, not on demand"


@dataclass(frozen=True)
class GroupCost:
    """One node group: `count` instances of a type, and what the catalog says one costs (None: unknown)."""

    group: str
    instance_type: str
    count: int
    price: Price | None
    why_unknown: str = ""

    @property
    def usd_per_hour(self) -> float | None:
        return None if self.price is None else self.count * self.price.usd_per_hour

    def to_dict(self) -> dict[str, Any]:
        return {
            "group": self.group, "instance_type": self.instance_type, "count": self.count,
            "usd_per_hour_each": self.price.usd_per_hour if self.price else None,
            "usd_per_hour": _rounded(self.usd_per_hour),
            "price_source": self.price.source if self.price else None,
            "price_as_of": self.price.as_of.isoformat() if self.price else None,
            "unknown": self.why_unknown or None,
        }


@dataclass(frozen=True)
class ClusterCost:
    region: str
    groups: tuple[GroupCost, ...]

    @property
    def unknown(self) -> list[str]:
        return [g.group for g in self.groups if g.price is None]

    @property
    def unknown_types(self) -> list[str]:
        """The instance types of the unpriced groups, each once: what a price is looked up by."""
        return list(dict.fromkeys(g.instance_type for g in self.groups if g.price is None))

    @property
    def total_usd_per_hour(self) -> float | None:
        """The sum over the groups whose price is known; None when none is. A lower bound while any is unknown."""
        known = [g.usd_per_hour for g in self.groups if g.usd_per_hour is not None]
        return sum(known) if known else None

    @property
    def complete(self) -> bool:
        return not self.unknown

    def sources(self) -> list[str]:
        """`source, checked DATE` for each distinct catalog source the known prices come from."""
        seen = dict.fromkeys((g.price.source, g.price.as_of) for g in self.groups if g.price)
        return [f"{source}, checked {as_of.isoformat()}" for source, as_of in seen]

    def to_dict(self) -> dict[str, Any]:
        return {
            "basis": "catalog on-demand prices, Linux", "region": self.region, "currency": "USD",
            "groups": [g.to_dict() for g in self.groups],
            "total_usd_per_hour": _rounded(self.total_usd_per_hour),
            "total_is_lower_bound": bool(self.unknown) and self.total_usd_per_hour is not None,
            "unknown": self.unknown,
        }

    def lines(self) -> list[str]:
        """One line per group, then the total: `cost  GROUP: N × TYPE × $P/h = $T/h`."""
        out = [f"cost  {_group_line(g)}" for g in self.groups]
        return out + [f"cost  total: {self._total_text()}"]

    def _total_text(self) -> str:
        total = self.total_usd_per_hour
        basis = f"catalog on-demand prices for {self.region}: {'; '.join(self.sources())}; --live not used"
        if total is None:
            return f"unknown (no price for {', '.join(self.unknown)})"
        if self.unknown:
            return f"at least {usd(total)}/h, not counting {', '.join(self.unknown)} ({basis})"
        return f"{usd(total)}/h ({basis})"


def _rounded(amount: float | None) -> float | None:
    return None if amount is None else round(amount, 6)


def usd(amount: float) -> str:
    """Dollars as people read them: cents at a dollar or more, four places below a dollar ($0.2016)."""
    return f"${amount:,.2f}" if amount >= 1 else f"${amount:.4f}"


def _group_line(g: GroupCost) -> str:
    head = f"{g.group}: {g.count} × {g.instance_type}"
    if g.price is None:
        return f"{head}: {g.why_unknown}"
    return f"{head} × {usd(g.price.usd_per_hour)}/h = {usd(g.usd_per_hour or 0.0)}/h"


def _group(name: str, instance_type: str, count: int, region: str, price_of: PriceLookup) -> GroupCost:
    price = price_of(instance_type, region)
    why = "" if price else (f"no catalog price for {instance_type} in {region} "
                            f"(`trainlift price {instance_type} --region {region} --live` asks AWS)")
    return GroupCost(name, instance_type, count, price, why)


def cluster_cost(spec: ClusterSpec, price_of: PriceLookup = catalog.on_demand_price) -> ClusterCost:
    """The on-demand $/hour of the spec's system group and each worker group, at full size."""
    groups = [_group(SYSTEM_GROUP, spec.system.instance_type, spec.system.count, spec.region, price_of)]
    for w in spec.workers:
        if w.capacity_block:
            groups.append(GroupCost(w.name, w.instance_type, w.count, None, _CAPACITY_BLOCK))
        else:
            groups.append(_group(w.name, w.instance_type, w.count, spec.region, price_of))
    return ClusterCost(spec.region, tuple(groups))
