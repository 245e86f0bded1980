"""What differs between the spec and what runs, and how each difference is applied. Pure.

A node group's size is changed in place (`eksctl scale nodegroup`); its instance type
or AZ can only change by replacing the group, which the plan says and does not do.
The control plane's API endpoint CIDRs and the VPC CNI's NetworkPolicy switch are set in place.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainlift.cloud.eks_state import NodeGroupInfo
from trainlift.config.cluster import ClusterSpec
from trainlift.ops import eksctl
from trainlift.ops.steps import ABSENT, Files, Observed, Op, Step, run_op


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



SETTINGS_TITLE = "EKS API endpoint access (publicAccessCIDRs) and NetworkPolicy enforcement (vpc-cni)"


def _api_access(spec: ClusterSpec, seen: Observed, config: str) -> tuple[str, list[Op], str]:
    """(what was seen, the ops that set the spec's CIDRs, a note) for the control plane's public endpoint."""
    have = sorted(seen.api_cidrs or ())
    shown = ", ".join(have) or "every address"
    want = sorted(spec.api_access_cidrs)
    if not want:
        return f"API endpoint open to {shown}", [], "no api_access_cidrs known, so the endpoint is left as it is"
    if have != want:
        return (f"API endpoint open to {shown}, the spec allows {', '.join(want)}",
                [run_op(eksctl.update_api_access(config))], "")
    return f"API endpoint limited to {', '.join(want)}", [], ""


def cluster_settings_step(spec: ClusterSpec, seen: Observed, files: Files) -> Step:
    """A cluster created before trainlift set them gets the spec's API endpoint CIDRs and the VPC CNI's NetworkPolicy
    enforcement (the rendered NetworkPolicy is inert without it); a new cluster is created with both."""
    if seen.control_plane in (None, ABSENT) or seen.control_plane not in ("ACTIVE", "UPDATING"):
        return Step("cluster-settings", SETTINGS_TITLE, "set when the control plane is created", "nothing")
    config = files.path("eksctl.yaml")
    observed, ops, note = _api_access(spec, seen, config)
    if seen.cni_network_policy is None:
        observed += f"; vpc-cni {seen.why('vpc-cni')}"
    elif seen.cni_network_policy:
        observed += "; vpc-cni enforces NetworkPolicy"
    else:
        observed += "; vpc-cni does not enforce NetworkPolicy"
        ops.append(run_op(eksctl.update_addon(config, "vpc-cni")))
    return Step("cluster-settings", SETTINGS_TITLE, observed, "apply" if ops else "nothing", tuple(ops), note=note)
