"""Whether an instance type can run N instances in a region, and where: facts in, verdict out.

Pure. `cloud/aws.py` gathers `CapacityFacts`; `assess` judges them: the AZs that offer
the type, the on-demand vCPU quota of its family against vCPUs already running,
capacity reservations and spot placement scores, then a recommended AZ with its
reason, or the problems that block it with the command that fixes each. A fact an
API would not give is `Unknown(reason)`: shown as unknown, never fatal.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any

import yaml


@dataclass(frozen=True)
class Unknown:
    reason: str


@dataclass(frozen=True)
class InstanceInfo:
    instance_type: str
    vcpus: int
    gpus: int = 0
    gpu_model: str | None = None
    gpu_memory_mib: int = 0
    efa_supported: bool = False
    efa_interfaces: int = 0


# EC2 capacity reservation states (CapacityReservationState): usable now, usable later, never again.
ACTIVE = "active"
UPCOMING = ("scheduled", "payment-pending", "pending", "assessing", "delayed")
ENDED = ("expired", "cancelled", "failed", "payment-failed", "unsupported", "cancelling", "unavailable")


@dataclass(frozen=True)
class Reservation:
    """An On-Demand Capacity Reservation (kind "default") or a Capacity Block (kind "capacity-block")."""

    id: str
    zone: str
    available: int
    total: int
    end: str | None = None
    instance_type: str = ""
    state: str = ACTIVE
    kind: str = "default"
    start: str | None = None

    @property
    def is_block(self) -> bool:
        return self.kind == "capacity-block"


_REQUESTED_QUANTITY_TAG = "aws:ec2capacityreservation:incrementalRequestedQuantity"
_RESERVATION_TYPE_TAG = "aws:ec2capacityreservation:capacityReservationType"


def _when(value: Any) -> str | None:
    if value is None or value == "":
        return None
    return value.isoformat() if hasattr(value, "isoformat") else str(value)


def reservation_from_ec2(r: dict[str, Any]) -> Reservation:
    """A DescribeCapacityReservations item. A block before its start shows 0 instances; its size is in a tag."""
    tags = {t.get("Key"): t.get("Value") for t in r.get("Tags") or []}
    total = int(r.get("TotalInstanceCount") or 0) or int(tags.get(_REQUESTED_QUANTITY_TAG) or 0)
    kind = r.get("ReservationType") or tags.get(_RESERVATION_TYPE_TAG) or "default"
    return Reservation(
        r["CapacityReservationId"].strip(), r["AvailabilityZone"], int(r.get("AvailableInstanceCount") or 0), total,
        _when(r.get("EndDate")), r.get("InstanceType", ""), r.get("State", ACTIVE), kind, _when(r.get("StartDate")))


@dataclass(frozen=True)
class Quota:
    code: str
    name: str
    families: tuple[str, ...]


@dataclass(frozen=True)
class CapacityFacts:
    region: str
    count: int
    info: InstanceInfo
    zones: dict[str, str]  # every AZ of the region, name -> zone id, in the region's order
    offered: list[str] | Unknown
    quota: Quota | None
    quota_vcpus: float | Unknown
    vcpus_in_use: int | Unknown
    reservations: list[Reservation] | Unknown
    spot_scores: dict[str, int] | Unknown  # AZ name -> score 1..10


@dataclass(frozen=True)
class ZoneRow:
    zone: str
    zone_id: str
    offered: bool | None
    reserved: int | None
    spot_score: int | None
    upcoming: int | None = None  # instances of reservations that have not started (Capacity Blocks)


@dataclass
class CapacityReport:
    facts: CapacityFacts
    rows: list[ZoneRow]
    needed_vcpus: int
    free_vcpus: float | None
    recommended: str | None
    reason: str
    problems: list[str] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)
    unknown: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        f = self.facts
        known = lambda v: None if isinstance(v, Unknown) else v  # noqa: E731
        return {
            "instance_type": f.info.instance_type,
            "region": f.region,
            "count": f.count,
            "instance": asdict(f.info),
            "offered_zones": known(f.offered),
            "zones": [asdict(r) for r in self.rows],
            "quota": None if f.quota is None else {
                "code": f.quota.code, "name": f.quota.name,
                "vcpus": known(f.quota_vcpus), "in_use": known(f.vcpus_in_use),
            },
            "needed_vcpus": self.needed_vcpus,
            "free_vcpus": self.free_vcpus,
            "reservations": None if isinstance(f.reservations, Unknown) else [asdict(r) for r in f.reservations],
            "recommended_zone": self.recommended,
            "reason": self.reason,
            "problems": self.problems,
            "fixes": self.fixes,
            "unknown": self.unknown,
            "ok": self.ok,
        }


@lru_cache(maxsize=1)
def _quota_table() -> dict[str, Quota]:
    data = yaml.safe_load(resources.files("trainlift.cloud").joinpath("quotas.yaml").read_text())
    return {code: Quota(code, q["name"], tuple(q["families"])) for code, q in data["quotas"].items()}


def family(instance_type: str) -> str:
    match = re.match(r"[a-z]+", instance_type.split(".", 1)[0])
    return match.group(0) if match else ""


def quota_for(instance_type: str) -> Quota | None:
    """The on-demand vCPU quota that counts this type; longest family match wins (trn before t)."""
    letters = family(instance_type)
    by_family = {fam: q for q in _quota_table().values() for fam in q.families}
    return by_family.get(letters) or by_family.get(letters[:1])


def increase_command(quota: Quota, region: str, desired: float) -> str:
    return (
        "aws service-quotas request-service-quota-increase --service-code ec2 "
        f"--quota-code {quota.code} --desired-value {math.ceil(desired)} --region {region}"
    )


def _unknowns(f: CapacityFacts) -> dict[str, str]:
    out = {}
    for key in ("offered", "quota_vcpus", "vcpus_in_use", "reservations", "spot_scores"):
        value = getattr(f, key)
        if isinstance(value, Unknown):
            out[key] = value.reason
    if f.quota is None:
        out["quota_vcpus"] = f"no on-demand vCPU quota is known for the {family(f.info.instance_type)!r} family"
    return out


def _reserved(f: CapacityFacts, upcoming: bool = False) -> dict[str, int]:
    """Per AZ: instances free in active reservations, or (upcoming) held by reservations yet to start."""
    out: dict[str, int] = {}
    if not isinstance(f.reservations, Unknown):
        for r in f.reservations:
            if upcoming and r.state in UPCOMING:
                out[r.zone] = out.get(r.zone, 0) + r.total
            elif not upcoming and r.state == ACTIVE:
                out[r.zone] = out.get(r.zone, 0) + r.available
    return out


def _upcoming_reason(f: CapacityFacts, zone: str) -> str:
    blocks = [r for r in f.reservations if r.zone == zone and r.state in UPCOMING]  # type: ignore[union-attr]
    first = min(blocks, key=lambda r: r.start or "")
    what = "a Capacity Block" if first.is_block else "a future capacity reservation"
    return (f"{what} ({first.id}, {first.state}) holds {first.total} {f.info.instance_type} there from "
            f"{first.start or 'its start date'}; create the node group with 0 nodes until then")


def _rank(f: CapacityFacts, candidates: list[str]) -> tuple[str, str]:
    """(zone, reason) among candidate AZs, best first: reservation now, reservation later, spot score, order."""
    reserved, later = _reserved(f), _reserved(f, upcoming=True)
    scores = {} if isinstance(f.spot_scores, Unknown) else f.spot_scores
    order = list(f.zones)

    def key(zone: str) -> tuple[int, ...]:
        now, soon = reserved.get(zone, 0), later.get(zone, 0)
        return (-int(now >= f.count), -int(soon >= f.count), -now, -soon, -scores.get(zone, 0),
                order.index(zone) if zone in order else 99)

    best = sorted(candidates, key=key)[0]
    if reserved.get(best, 0) >= f.count:
        return best, f"capacity reservations hold {reserved[best]} available {f.info.instance_type} there"
    if later.get(best, 0) >= f.count:
        return best, _upcoming_reason(f, best)
    if reserved.get(best, 0):
        return best, f"capacity reservations hold {reserved[best]} of the {f.count} instances there"
    if scores.get(best):
        return best, f"highest spot placement score ({scores[best]}/10), a proxy for spare capacity"
    if len(candidates) == 1:
        return best, "the only AZ that offers it"
    return best, (
        f"offered in {len(candidates)} AZs; no reservation or placement score prefers one, so the first in region order"
    )


def assess(f: CapacityFacts, allowed: list[str] | None = None) -> CapacityReport:
    """Judge the facts; `allowed` limits the AZs a recommendation may name (the cluster's AZs)."""
    itype, needed = f.info.instance_type, f.count * f.info.vcpus
    offered = None if isinstance(f.offered, Unknown) else set(f.offered)
    reserved, later = _reserved(f), _reserved(f, upcoming=True)
    scores = {} if isinstance(f.spot_scores, Unknown) else f.spot_scores
    known = not isinstance(f.reservations, Unknown)
    rows = [
        ZoneRow(z, zid, None if offered is None else z in offered, reserved.get(z, 0) if known else None,
                scores.get(z), later.get(z, 0) if known else None)
        for z, zid in f.zones.items()
    ]
    report = CapacityReport(f, rows, needed, None, None, "", unknown=_unknowns(f))

    if offered is not None and not offered:
        report.problems.append(f"{itype} is not offered in any AZ of {f.region}")
    scope = [z for z in f.zones if allowed is None or z in allowed]
    candidates = [z for z in scope if offered is None or z in offered] if offered is not None else []
    if offered and allowed is not None and not candidates:
        report.problems.append(
            f"{itype} is not offered in {', '.join(allowed)} (offered in {', '.join(sorted(offered))})"
        )

    quota, in_use = f.quota_vcpus, f.vcpus_in_use
    if f.quota is not None and not isinstance(quota, Unknown):
        used = 0 if isinstance(in_use, Unknown) else in_use
        report.free_vcpus = quota - used
        if report.free_vcpus < needed:
            short = needed - report.free_vcpus
            report.problems.append(
                f"vCPU quota shortfall: {f.count}x {itype} needs {needed} vCPUs; {f.quota.name} ({f.quota.code}) "
                f"is {quota:g} with {used} in use, {short:g} vCPUs short"
            )
            report.fixes.append(increase_command(f.quota, f.region, used + needed))

    if report.problems:
        report.reason = "blocked: " + "; ".join(report.problems)
    elif candidates:
        report.recommended, report.reason = _rank(f, candidates)
    elif offered is None and allowed and len(allowed) == 1:
        report.recommended, report.reason = allowed[0], "pinned; whether it offers the type is unknown"
    else:
        report.reason = "which AZs offer it is unknown: " + report.unknown.get("offered", "no data")
    return report
