"""eksctl: the command lines trainlift plans, and parsers for `eksctl get ... -o json`.

The EKS API (cloud/aws.py) is the first source of control plane and node group state;
`eksctl get` through the runner is the fallback when that API is not permitted.
The argv builders are pure; `observe_with_eksctl` runs eksctl.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from trainlift.cloud.eks_state import ClusterInfo, NodeGroupInfo
from trainlift.cloud.capacity import Unknown
from trainlift.ops.run import INSTALL, run

TIMEOUT_S = 60


def create_cluster(config: str) -> list[str]:
    """The control plane, its VPC, OIDC, add-ons and IRSA service accounts; node groups come one by one."""
    return ["eksctl", "create", "cluster", "-f", config, "--without-nodegroup"]


def create_nodegroup(config: str, name: str) -> list[str]:
    """One node group. The NVIDIA device plugin is trainlift's (a pinned Helm release), so eksctl's own
    DaemonSet is turned off; eksctl's EFA DaemonSet has no such switch and is adopted by Helm later."""
    return ["eksctl", "create", "nodegroup", "-f", config, "--include", name, "--install-nvidia-plugin=false"]


def scale_nodegroup(cluster: str, region: str, name: str, count: int) -> list[str]:
    """A fixed size, as rendered: desired = min = max."""
    return ["eksctl", "scale", "nodegroup", "--cluster", cluster, "--region", region, "--name", name,
            "--nodes", str(count), "--nodes-min", str(count), "--nodes-max", str(count), "--wait"]


def create_service_accounts(config: str) -> list[str]:
    return ["eksctl", "create", "iamserviceaccount", "-f", config, "--approve"]


def update_service_accounts(config: str) -> list[str]:
    """Re-applies the IAM policy of service accounts that exist (create skips them)."""
    return ["eksctl", "update", "iamserviceaccount", "-f", config, "--approve"]


def delete_nodegroup(cluster: str, region: str, name: str) -> list[str]:
    return ["eksctl", "delete", "nodegroup", "--cluster", cluster, "--region", region, "--name", name, "--wait"]


def update_api_access(config: str) -> list[str]:
    """The control plane's public endpoint CIDRs set to the config's vpc.publicAccessCIDRs."""
    return ["eksctl", "utils", "update-cluster-vpc-config", "-f", config, "--approve"]


def update_addon(config: str, name: str) -> list[str]:
    """An EKS add-on set to the config's entry for it (its configurationValues included)."""
    return ["eksctl", "update", "addon", "-f", config, "--name", name]


def delete_cluster(cluster: str, region: str) -> list[str]:
    return ["eksctl", "delete", "cluster", "--name", cluster, "--region", region, "--wait"]


def _load(text: str) -> Any:
    """eksctl prints JSON with -o json and the same structure with -o yaml; accept either."""
    text = text.strip().rstrip("%")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return yaml.safe_load(text)


def parse_clusters(text: str) -> dict[str, str | None]:
    """`eksctl get cluster [-n NAME] -o json`: name -> status (None when the listing form has no status)."""
    out: dict[str, str | None] = {}
    for item in _load(text) or []:
        name = item.get("Name") or (item.get("metadata") or {}).get("name")
        if name:
            out[name] = item.get("Status")
    return out


def parse_nodegroups(text: str) -> dict[str, NodeGroupInfo]:
    """`eksctl get nodegroup --cluster C -o json`: name -> state (Status is absent from old eksctl)."""
    out: dict[str, NodeGroupInfo] = {}
    for item in _load(text) or []:
        name = item.get("Name")
        if not name:
            continue
        desired = item.get("DesiredCapacity")
        itype = item.get("InstanceType") or ""
        out[name] = NodeGroupInfo(
            name=name,
            status=str(item.get("Status") or "UNKNOWN"),
            desired=int(desired) if desired is not None else None,
            instance_types=tuple(t for t in itype.split(",") if t),
            zones=(),
        )
    return out


def observe_with_eksctl(cluster: str, region: str) -> tuple[ClusterInfo | None | Unknown, dict[str, NodeGroupInfo] | Unknown]:
    """The control plane and node groups as eksctl sees them; Unknown when eksctl cannot tell."""
    got = run(["eksctl", "get", "cluster", "--name", cluster, "--region", region, "-o", "json"], TIMEOUT_S)
    if got.absent:
        why = Unknown(f"eksctl not found ({INSTALL['eksctl']})")
        return why, why
    if not got.ok:
        if "No cluster found" in got.stderr or "ResourceNotFoundException" in got.stderr:
            return None, {}
        why = Unknown(f"eksctl get cluster failed: {got.stderr.strip()[-300:]}")
        return why, why
    status = parse_clusters(got.stdout).get(cluster)
    info = ClusterInfo(cluster, status or "ACTIVE", None, None, None)
    groups = run(["eksctl", "get", "nodegroup", "--cluster", cluster, "--region", region, "-o", "json"], TIMEOUT_S)
    if not groups.ok:
        return info, Unknown(f"eksctl get nodegroup failed: {groups.stderr.strip()[-300:]}")
    return info, parse_nodegroups(groups.stdout)
