"""The Ray head lands in the workers' AZ: the system node group is created there (eksctl.yaml) and the head pod
requires a node there (RayCluster affinity), checked on the rendered, schema-validated manifests."""

from __future__ import annotations

from pathlib import Path

import yaml

from trainlift.cloud.eks_state import NodeGroupInfo
from trainlift.config.cluster import cluster_spec_from_yaml
from trainlift.ops.placement import Placement
from trainlift.ops.plan import Files, Observed, plan_up
from trainlift.ops.preflight import OWNER_TAG
from trainlift.render import render_cluster

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = yaml.safe_load((ROOT / "examples" / "cluster-reference.yaml").read_text())
ZONE = "topology.kubernetes.io/zone"


def _rendered(data: dict) -> tuple[dict, dict]:
    """(eksctl's system node group, the RayCluster's head pod spec) as render writes them."""
    manifests = {m.path: m for m in render_cluster(cluster_spec_from_yaml(yaml.safe_dump(data)))}
    eksctl = yaml.safe_load(manifests["eksctl.yaml"].text())
    system = next(g for g in eksctl["managedNodeGroups"] if g["name"] == "system-nodes")
    raycluster = yaml.safe_load(manifests["k8s/20-raycluster.yaml"].text())
    return system, raycluster["spec"]["headGroupSpec"]["template"]["spec"]


def _head_zones(head: dict) -> list[str] | None:
    terms = (head.get("affinity", {}).get("nodeAffinity", {})
             .get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms"))
    if terms is None:
        return None
    assert len(terms) == 1 and terms[0]["matchExpressions"][0]["key"] == ZONE
    assert terms[0]["matchExpressions"][0]["operator"] == "In"
    return terms[0]["matchExpressions"][0]["values"]


def test_the_reference_head_and_system_group_are_in_the_workers_az():
    """The cluster spans us-east-2a and -2b (EKS needs two); the EFA workers are pinned to us-east-2a."""
    system, head = _rendered(REFERENCE)
    assert system["availabilityZones"] == ["us-east-2a"]
    assert _head_zones(head) == ["us-east-2a"]
    assert head["nodeSelector"] == {"role": "system"}


def test_workers_in_two_azs_keep_the_head_in_one_of_theirs():
    data = yaml.safe_load(yaml.safe_dump(REFERENCE))
    data["fabric"] = "socket"
    data["availability_zones"] = ["us-east-2a", "us-east-2b", "us-east-2c"]
    data["workers"].append({**data["workers"][0], "name": "more-workers", "availability_zones": ["us-east-2c"]})
    system, head = _rendered(data)
    assert system["availabilityZones"] == ["us-east-2a", "us-east-2c"] == _head_zones(head)


def test_unpinned_workers_leave_the_head_unconstrained():
    """Before `cluster up` pins a worker group's AZ (its capacity check chooses one), render cannot know it."""
    data = yaml.safe_load(yaml.safe_dump(REFERENCE))
    data["fabric"] = "socket"
    del data["workers"][0]["availability_zones"]
    system, head = _rendered(data)
    assert "availabilityZones" not in system and _head_zones(head) is None


def test_a_system_group_spread_over_two_azs_is_replaced_not_kept():
    """A cluster whose system group spans both AZs (as before) could keep its only system node in the other one:
    the plan says only a new node group can have the workers' AZ."""
    spec = cluster_spec_from_yaml((ROOT / "examples" / "cluster-reference.yaml").read_text())
    groups = {"system-nodes": NodeGroupInfo("system-nodes", "ACTIVE", 1, ("m7i.xlarge",), ("us-east-2a", "us-east-2b")),
              "gpu-workers": NodeGroupInfo("gpu-workers", "ACTIVE", 2, ("g6.12xlarge",), ("us-east-2a",))}
    seen = Observed("ACTIVE", groups, tags={OWNER_TAG: "ray-train"}, unknown={"kubernetes": "not observed"})
    placed = {"gpu-workers": Placement("gpu-workers", "us-east-2a", "where the existing node group runs")}
    step = next(s for s in plan_up(spec, seen, placed, Files(".trainlift/ray-train")).steps
                if s.key == "nodegroup/system-nodes")
    assert step.action == "blocked" and "AZ us-east-2a, us-east-2b -> us-east-2a" in step.note
