"""What differs between the spec and what runs, and how each difference is applied. Pure.

A node group's size is changed in place (`eksctl scale nodegroup`); its instance type
or AZ can only change by replacing the group, which the plan says and does not do.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainlift.cloud.eks_state import NodeGroupInfo


@dataclass(frozen=True)
class GroupWant:
    name: str
    instance_type: str
    count: int
    zones: tuple[str, ...]  # empty: any


@dataclass(frozen=True)
class Drift:
    resize: int | None  # the node count to scale to, when only that differs in place
    replace: tuple[str, ...]  # differences that need the group re-created

    @property
    def none(self) -> bool:
        return self.resize is None and not self.replace


def nodegroup_drift(want: GroupWant, group: NodeGroupInfo) -> Drift:
    replace = []
    if group.instance_types and want.instance_type not in group.instance_types:
        replace.append(f"instance type {', '.join(group.instance_types)} -> {want.instance_type}")
    if want.zones and group.zones and set(group.zones) != set(want.zones):
        replace.append(f"AZ {', '.join(group.zones)} -> {', '.join(want.zones)}")
    resize = want.count if group.desired is not None and group.desired != want.count else None
    return Drift(resize, tuple(replace))

