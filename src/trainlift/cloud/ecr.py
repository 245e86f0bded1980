"""What private ECR says about an image: its digest, for pinning the pods' image (render, cluster up)."""

from __future__ import annotations

import re

from trainlift.cloud.aws import Aws
from trainlift.cloud.aws_errors import error_code, error_message, fatal_error, is_api_error
from trainlift.cloud.capacity import Unknown


def image_digest(image: str) -> str | Unknown:
    """The digest a private ECR registry holds for `<account>.dkr.ecr.<region>.amazonaws.com/<repo>:<tag>`, through
    ecr:DescribeImages; Unknown(reason) for other registries, without credentials, or when the call fails."""
    match = re.fullmatch(r"(\d{12})\.dkr\.ecr\.([a-z0-9-]+)\.amazonaws\.com(?:\.cn)?/([^:@]+):([\w][\w.-]*)", image)
    if match is None:
        return Unknown(f"{image.split('/', 1)[0]} is not a private ECR registry, the only kind looked up "
                       "(image.cache: ecr, or a mirror in ECR, pins it by digest)")
    account, region, repository, tag = match.groups()
    try:
        out = Aws(region).client("ecr").describe_images(
            registryId=account, repositoryName=repository, imageIds=[{"imageTag": tag}])
    except Exception as exc:
        fatal = fatal_error(exc, "ecr:DescribeImages")
        if fatal is not None:
            return Unknown(f"ecr:DescribeImages: {fatal.message}")
        if is_api_error(exc):
            return Unknown(f"ecr:DescribeImages: {error_code(exc)}: {error_message(exc)}")
        raise
    details = out.get("imageDetails") or []
    return details[0]["imageDigest"] if details else Unknown(f"ecr:DescribeImages: no image tagged {tag}")
