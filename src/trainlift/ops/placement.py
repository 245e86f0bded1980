"""Where each worker group goes: capacity verdicts turned into AZs and a spec that pins them. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from trainlift.cloud.eks_state import NodeGroupInfo
from trainlift.cloud.capacity import CapacityReport
from trainlift.config.cluster import ClusterSpec

EKS_MIN_ZONES = 2


@dataclass(frozen=True)
class Placement:
    group: str
    zone: str | None
    reason: str
    blocking: str = ""
    fix: str = ""


def allowed_zones(spec: ClusterSpec, group: str) -> list[str] | None:
    """The AZs a worker group may use: its own pin, else the cluster's AZs, else any."""
    w = next(w for w in spec.workers if w.name == group)
    return list(w.availability_zones or spec.availability_zones) or None


def place(spec: ClusterSpec, reports: dict[str, CapacityReport],
          existing: dict[str, NodeGroupInfo] | None) -> dict[str, Placement]:
    out: dict[str, Placement] = {}
    for i, w in enumerate(spec.workers):
        group = (existing or {}).get(w.name)
        if group is not None:
            zone = group.zones[0] if len(group.zones) == 1 else (w.availability_zones or [None])[0]
            out[w.name] = Placement(w.name, zone, "where the existing node group runs")
            continue
        report = reports.get(w.name)
        pinned = w.availability_zones[0] if len(w.availability_zones) == 1 else None
        if report is None:
            out[w.name] = Placement(w.name, pinned, "pinned in the spec" if pinned else "capacity not checked")
            continue
        if report.problems:
            out[w.name] = Placement(w.name, pinned, report.reason, blocking="; ".join(report.problems),
                                    fix=" && ".join(report.fixes))
        elif pinned:
            out[w.name] = Placement(w.name, pinned, "pinned in the spec; offered there")
        elif report.recommended:
            out[w.name] = Placement(w.name, report.recommended, report.reason)
        else:
            out[w.name] = Placement(w.name, None, report.reason, blocking=f"no AZ could be chosen: {report.reason}",
                                    fix=f"pin workers[{i}].availability_zones in the spec")
    return out


def resolve_spec(spec: ClusterSpec, placements: dict[str, Placement], region_zones: list[str],
                 system_offered: list[str] | None) -> ClusterSpec:
    """The spec with every worker group pinned to its AZ and cluster AZs that include them."""
    data = spec.model_dump()
    chosen: list[str] = []
    for w in data["workers"]:
        p = placements.get(w["name"])
        if not w["availability_zones"] and p is not None and p.zone:
            w["availability_zones"] = [p.zone]
        chosen += [z for z in w["availability_zones"] if z not in chosen]
    if not data["availability_zones"] and chosen:
        zones = sorted(chosen)
        for z in region_zones:
            if len(zones) >= EKS_MIN_ZONES:
                break
            if z not in zones and (system_offered is None or z in system_offered):
                zones.append(z)
        data["availability_zones"] = zones
    return ClusterSpec.model_validate(data)
