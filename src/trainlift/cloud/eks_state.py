"""What EKS and CloudFormation say about a cluster, as plain records: read by `cloud/aws.py`, judged by the pure
lifecycle planning in `ops/`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ClusterInfo:
    name: str
    status: str
    version: str | None
    endpoint: str | None
    ca_data: str | None
    public_access_cidrs: tuple[str, ...] = ()  # who may reach the public API endpoint (EKS's default: 0.0.0.0/0)


@dataclass(frozen=True)
class NodeGroupInfo:
    name: str
    status: str
    desired: int | None
    instance_types: tuple[str, ...]
    zones: tuple[str, ...]
    issues: tuple[str, ...] = ()


CLUSTER_STACK = "eksctl-{name}-cluster"  # the stack `eksctl create cluster` names after the cluster
# The stack `eksctl create nodegroup` makes for each group: makeNodeGroupStackName in eksctl's
# pkg/cfn/manager/nodegroup.go (v0.230.0).
NODEGROUP_STACK = "eksctl-{cluster}-nodegroup-{group}"


@dataclass(frozen=True)
class StackInfo:
    name: str
    status: str
    tags: dict[str, str]


@dataclass(frozen=True)
class ClusterTags:
    arn: str
    tags: dict[str, str]
