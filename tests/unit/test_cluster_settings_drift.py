"""A cluster made before trainlift limited its API endpoint and turned on NetworkPolicy enforcement is brought to
the spec by the next `cluster up`: the control plane's publicAccessCidrs and the vpc-cni add-on's
enableNetworkPolicy are read from EKS and set in place with eksctl when they differ.

No EKS endpoint is reachable here: describe_cluster and describe_addon answer through botocore's Stubber with the
fields of recorded EKS responses (a cluster created with eksctl's defaults reports publicAccessCidrs 0.0.0.0/0, and
an add-on with no configuration values omits configurationValues)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import yaml

from trainlift.config.cluster import parse_cluster_spec
from trainlift.ops.plan import Files, Observed, plan_up

ROOT = Path(__file__).resolve().parents[2]
SPEC = parse_cluster_spec({**yaml.safe_load((ROOT / "examples" / "cluster-reference.yaml").read_text()),
                           "api_access_cidrs": ["203.0.113.7/32"]})
FILES = Files(".trainlift/ray-train")


def _described(cidrs: list[str]) -> dict:
    return {"cluster": {"name": "ray-train", "status": "ACTIVE", "version": "1.36",
                        "endpoint": "https://ABC.gr7.us-east-2.eks.amazonaws.com",
                        "certificateAuthority": {"data": "Q0E="},
                        "resourcesVpcConfig": {"subnetIds": ["subnet-1", "subnet-2"], "endpointPublicAccess": True,
                                               "endpointPrivateAccess": False, "publicAccessCidrs": cidrs}}}


def _addon(values: str | None) -> dict:
    addon = {"addonName": "vpc-cni", "clusterName": "ray-train", "status": "ACTIVE", "addonVersion": "v1.21.1-eksbuild.1"}
    return {"addon": {**addon, **({"configurationValues": values} if values is not None else {})}}


def _seen(stubbed_aws, cidrs: list[str], addon: dict | None, addon_error: str = "") -> Observed:
    aws, stub = stubbed_aws("eks")
    stub.add_response("describe_cluster", _described(cidrs), {"name": "ray-train"})
    if addon_error:
        stub.add_client_error("describe_addon", addon_error, "not allowed")
    else:
        stub.add_response("describe_addon", addon, {"clusterName": "ray-train", "addonName": "vpc-cni"})
    from trainlift.ops.lifecycle import _observe_network_policy

    info, unknown = aws.cluster("ray-train"), {}
    policy = _observe_network_policy(SPEC, aws, unknown)
    stub.assert_no_pending_responses()
    return replace(Observed.nothing(), control_plane=info.status, api_cidrs=info.public_access_cidrs,
                   unknown=unknown, **policy)


def _step(seen: Observed):
    return next(s for s in plan_up(SPEC, seen, {}, FILES).steps if s.key == "cluster-settings")


def test_an_open_endpoint_and_an_unenforcing_cni_are_set_to_the_spec(stubbed_aws):
    step = _step(_seen(stubbed_aws, ["0.0.0.0/0"], _addon(None)))
    assert step.action == "apply"
    assert step.observed == ("API endpoint open to 0.0.0.0/0, the spec allows 203.0.113.7/32; "
                             "vpc-cni does not enforce NetworkPolicy")
    assert [" ".join(op.argv) for op in step.ops] == [
        "eksctl utils update-cluster-vpc-config -f .trainlift/ray-train/eksctl.yaml --approve",
        "eksctl update addon -f .trainlift/ray-train/eksctl.yaml --name vpc-cni"]


def test_a_cluster_that_matches_the_spec_is_left_alone(stubbed_aws):
    step = _step(_seen(stubbed_aws, ["203.0.113.7/32"], _addon('{"enableNetworkPolicy": "true"}')))
    assert step.action == "nothing" and not step.ops
    assert step.observed == "API endpoint limited to 203.0.113.7/32; vpc-cni enforces NetworkPolicy"


def test_an_unreadable_add_on_is_said_and_not_guessed(stubbed_aws):
    step = _step(_seen(stubbed_aws, ["203.0.113.7/32"], None, addon_error="AccessDeniedException"))
    assert step.action == "nothing"
    assert "vpc-cni unknown (eks:DescribeAddon: AccessDeniedException: not allowed)" in step.observed


def test_a_new_cluster_is_created_with_both():
    step = _step(Observed.nothing())
    assert step.action == "nothing" and step.observed == "set when the control plane is created"
