"""`image.cache: ecr`: the pods run the image through the region's ECR pull-through cache, every node group may
import into the cache's repositories, and `cluster up` creates the rule before any node pulls through it.

No ECR runs here (moto has no pull-through cache API): the observation reads DescribePullThroughCacheRules responses
in the shape the ECR API reference gives, served by botocore's Stubber; the manifests are checked against eksctl's
schema as every render is."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trainlift.cloud.capacity import Unknown
from trainlift.config.cluster import parse_cluster_spec
from trainlift.errors import SpecError
from trainlift.ops.plan import Files, Observed, plan_up
from trainlift.render import render_cluster

ROOT = Path(__file__).resolve().parents[2]
ACCOUNT = "123456789012"
CACHED = f"{ACCOUNT}.dkr.ecr.us-east-2.amazonaws.com/ecr-public/deep-learning-containers/ray:train-ml-cuda-v1.1.0"


def spec(**image):
    data = yaml.safe_load((ROOT / "examples" / "cluster-reference.yaml").read_text())
    data["image"] = {**data.get("image", {}), **image}
    return parse_cluster_spec(data)


def test_the_pods_pull_through_the_cache_and_every_node_group_may_import():
    manifests = {m.path: m.body for m in render_cluster(spec(cache="ecr", account=ACCOUNT))}
    cluster = manifests["k8s/20-raycluster.yaml"]["spec"]
    images = {c["image"] for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
              for c in group["template"]["spec"]["containers"]}
    assert images == {CACHED}  # the floating -v1 tag as the release it stands for, served by the cache
    for group in manifests["eksctl.yaml"]["managedNodeGroups"]:
        [statement] = group["iam"]["attachPolicy"]["Statement"]
        assert statement["Action"] == ["ecr:BatchImportUpstreamImage", "ecr:CreateRepository"]
        assert statement["Resource"] == f"arn:aws:ecr:us-east-2:{ACCOUNT}:repository/ecr-public/*"


@pytest.mark.parametrize("image, line", [
    ({"cache": "ecr"}, "image.account: image.cache: ecr needs the AWS account of the cache"),
    ({"cache": "ecr", "account": ACCOUNT, "uri": "nvcr.io/nvidia/pytorch:25.01-py3", "ray_version": "2.58.0"},
     "image.cache: ecr caches images from public.ecr.aws; nvcr.io/nvidia/pytorch:25.01-py3 is not one"),
])
def test_a_cache_that_cannot_serve_the_image_is_refused_in_one_line(image, line):
    with pytest.raises(SpecError) as caught:
        render_cluster(spec(**image))
    assert line in caught.value.message and "\n" not in caught.value.message


def cache_step(seen: Observed):
    plan = plan_up(spec(cache="ecr", account=ACCOUNT), seen, {}, Files(".trainlift/ray-train"))
    keys = [s.key for s in plan.steps]
    assert keys.index("image-cache") < keys.index("nodegroup/system-nodes")
    return plan.steps[keys.index("image-cache")]


def test_up_creates_the_rule_before_the_node_groups_and_leaves_an_existing_one():
    step = cache_step(Observed.nothing())
    assert step.action == "create" and [op.text() for op in step.ops] == [
        "aws ecr create-pull-through-cache-rule --ecr-repository-prefix ecr-public --upstream-registry-url "
        "public.ecr.aws --region us-east-2"]
    from dataclasses import replace

    assert cache_step(replace(Observed.nothing(), cache_rule="public.ecr.aws")).action == "nothing"
    other = cache_step(replace(Observed.nothing(), cache_rule="registry-1.docker.io"))
    assert other.action == "blocked" and "caches another registry" in other.note
    unknown = cache_step(replace(Observed("ACTIVE", {}), unknown={"image-cache": "AccessDenied"}))
    assert unknown.action == "blocked" and "ecr:DescribePullThroughCacheRules" in unknown.fix


def test_the_rule_is_read_from_ecr(stubbed_aws):
    aws, stubber = stubbed_aws("ecr")
    params = {"ecrRepositoryPrefixes": ["ecr-public"]}
    stubber.add_response("describe_pull_through_cache_rules", {"pullThroughCacheRules": [{
        "ecrRepositoryPrefix": "ecr-public", "upstreamRegistryUrl": "public.ecr.aws", "registryId": ACCOUNT,
        "upstreamRegistry": "ecr-public"}]}, params)
    stubber.add_client_error("describe_pull_through_cache_rules",
                             service_error_code="PullThroughCacheRuleNotFoundException", http_status_code=400,
                             service_message="The pull-through cache rule with prefix 'ecr-public' does not exist",
                             expected_params=params)
    stubber.add_client_error("describe_pull_through_cache_rules", service_error_code="AccessDeniedException",
                             http_status_code=400, service_message="not authorized", expected_params=params)
    assert aws.pull_through_rule("ecr-public") == "public.ecr.aws"
    assert aws.pull_through_rule("ecr-public") is None
    assert isinstance(aws.pull_through_rule("ecr-public"), Unknown)
