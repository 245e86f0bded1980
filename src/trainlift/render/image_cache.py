"""`image.cache: ecr`: the image pulled through an ECR pull-through cache rule instead of from ECR Public by every
node. The first pull in the region fetches it from upstream into a private repository `<prefix>/<repository>`;
later pulls (every other node, every later cluster) come from the region's ECR, whose digests can be looked up.
Pure: names and the nodes' IAM policy (Amazon ECR user guide, "Sync an upstream registry with an Amazon ECR private
registry": the rule, the `<prefix>/` repositories, and the ecr:BatchImportUpstreamImage and ecr:CreateRepository
a puller needs for the first pull)."""

from __future__ import annotations

from typing import Any

from trainlift.config.cluster import ClusterSpec
from trainlift.render.problems import Problem

CACHE_PREFIX = "ecr-public"
UPSTREAM = "public.ecr.aws"


def registry(account: str, region: str) -> str:
    suffix = ".com.cn" if region.startswith("cn-") else ".com"
    return f"{account}.dkr.ecr.{region}.amazonaws{suffix}"


def cached_uri(uri: str, account: str, region: str) -> str:
    """`public.ecr.aws/<repository>[:tag|@digest]` as the cache serves it."""
    return f"{registry(account, region)}/{CACHE_PREFIX}/{uri[len(UPSTREAM) + 1:]}"


def with_account(spec: ClusterSpec, account: str) -> ClusterSpec:
    """The spec with the cache's account filled in from the credentials, where it needs one and has none."""
    if spec.image.cache != "ecr" or spec.image.account is not None or not account:
        return spec
    return spec.model_copy(update={"image": spec.image.model_copy(update={"account": account})})


def cache_problems(spec: ClusterSpec) -> list[Problem]:
    if spec.image.cache != "ecr":
        return []
    if not spec.image.uri.startswith(UPSTREAM + "/"):
        return [Problem("image.cache", f"ecr caches images from {UPSTREAM}; {spec.image.uri} is not one",
                        hint="drop image.cache, or use an image from ECR Public")]
    if spec.image.account is None:
        return [Problem("image.account", "image.cache: ecr needs the AWS account of the cache",
                        hint="run with AWS credentials (cluster up and render fill it in), or set image.account")]
    return []


def node_policy(spec: ClusterSpec) -> dict[str, Any] | None:
    """The inline policy every node group gets beside eksctl's defaults: the first pull of a cached image imports
    it from upstream and creates its repository, with the node's own role."""
    if spec.image.cache != "ecr" or spec.image.account is None:
        return None
    partition = "aws-cn" if spec.region.startswith("cn-") else "aws"
    return {"Version": "2012-10-17", "Statement": [{
        "Effect": "Allow",
        "Action": ["ecr:BatchImportUpstreamImage", "ecr:CreateRepository"],
        "Resource": f"arn:{partition}:ecr:{spec.region}:{spec.image.account}:repository/{CACHE_PREFIX}/*",
    }]}


def create_rule_argv(region: str) -> list[str]:
    return ["aws", "ecr", "create-pull-through-cache-rule", "--ecr-repository-prefix", CACHE_PREFIX,
            "--upstream-registry-url", UPSTREAM, "--region", region]
