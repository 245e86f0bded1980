"""What an image's registry says about it, before any node bills: whether its tag (or digest) exists, the tags the
repository does have when it does not, and its digest, for pinning the pods' image (render, cluster up).

Private ECR through ecr:DescribeImages and ecr:ListImages. ECR Public through its anonymous registry API (the OCI
distribution API: a pull token from https://public.ecr.aws/token/, then `/v2/<repository>/manifests/<ref>` and
`/v2/<repository>/tags/list`, which AWS opened to anyone in aws/containers-roadmap#1262): it needs no AWS
credentials, where ecr-public's DescribeImageTags answers only a registry's owner. Other registries are not looked
up. Which line to print is decided by the pure functions at the top.
"""

from __future__ import annotations

import difflib
import json
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from trainlift.cloud.aws import Aws
from trainlift.cloud.aws_errors import error_code, error_message, fatal_error, is_api_error
from trainlift.cloud.capacity import Unknown

PUBLIC_REGISTRY = "public.ecr.aws"
PUBLIC_REGISTRY_URL = "https://public.ecr.aws"  # where the anonymous registry API is reached (tests point it elsewhere)
PRIVATE_ECR = re.compile(r"(\d{12})\.dkr\.ecr\.([a-z0-9-]+)\.amazonaws\.com(?:\.cn)?")
# What a registry may answer a manifest request with (an image index or a single image, OCI or Docker's).
MANIFEST_TYPES = ", ".join([
    "application/vnd.oci.image.index.v1+json", "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.docker.distribution.manifest.v2+json",
])
CLOSEST = 3
TIMEOUT_S = 10.0
MAX_TAG_PAGES = 50


# --- pure ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ImageName:
    registry: str
    repository: str
    tag: str = ""
    digest: str = ""

    @property
    def reference(self) -> str:
        """What the registry's manifests endpoint takes: the digest when there is one, else the tag."""
        return self.digest or self.tag


def parse_image(image: str) -> ImageName:
    """`registry/repository[:tag][@digest]`; a reference without a tag or digest means `latest`, as in Docker."""
    rest, _, digest = image.partition("@")
    registry, _, path = rest.partition("/")
    repository, _, tag = path.rpartition(":") if ":" in path else (path, "", "")
    return ImageName(registry, repository, tag or ("" if digest else "latest"), digest)


def closest_tags(want: str, tags: list[str] | tuple[str, ...], n: int = CLOSEST) -> list[str]:
    """The `n` tags most like `want`: the longest prefix in common first (a release's siblings share theirs), then the
    most characters in common."""
    def likeness(tag: str) -> tuple[int, float]:
        prefix = len(next((tag[:i] for i in range(min(len(tag), len(want)), 0, -1) if tag[:i] == want[:i]), ""))
        return prefix, difflib.SequenceMatcher(None, want, tag).ratio()

    return sorted((t for t in tags if t != want), key=likeness, reverse=True)[:n]


@dataclass(frozen=True)
class ImageLookup:
    """What the registry said: the image exists (with its digest, where the registry gives one), or it does not, with
    the tags its repository lists (None when it lists none it would show, or the repository itself is missing)."""

    image: str
    found: bool
    digest: str = ""
    tags: tuple[str, ...] | None = None
    repository_missing: bool = False

    def absent_line(self) -> str:
        """The one line that stops `cluster up` and `render` ("" when the image exists)."""
        if self.found:
            return ""
        name = parse_image(self.image)
        where = f"{name.registry}/{name.repository}"
        if self.repository_missing:
            return f"image {self.image} does not exist: {name.registry} has no repository {name.repository}"
        what = f"no image with digest {name.digest}" if name.digest else f"no tag {name.tag}"
        if self.tags is None:
            listed = ""
        elif not self.tags:
            listed = "; it lists no tags"
        else:
            listed = "; closest tags it has: " + ", ".join(closest_tags(name.tag, self.tags))
        return f"image {self.image} does not exist: {where} has {what}{listed}"


ABSENT_HINT = ("set image.uri in the cluster spec to a tag the registry has; every pod would otherwise fail "
               "ImagePullBackOff after its node starts billing")


# --- side effects ----------------------------------------------------------------------------------

def check_image(image: str) -> ImageLookup | Unknown:
    """Ask the image's registry (ECR Public or private ECR) whether it exists; Unknown(reason) for other registries
    and when the registry cannot be asked."""
    name = parse_image(image)
    if name.registry == PUBLIC_REGISTRY:
        return _public_lookup(image, name)
    if (match := PRIVATE_ECR.fullmatch(name.registry)) is not None:
        return _private_lookup(image, name, *match.groups())
    return Unknown(f"{name.registry} is not ECR Public or private ECR, the registries looked up")


def _get(url: str, token: str = "", method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    headers = {"Accept": MANIFEST_TYPES}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers or {}), exc.read() or b""


def _next_page(headers: dict[str, str]) -> str | None:
    """The `Link: <...>; rel="next"` of a paginated tags/list answer (OCI distribution spec, content discovery)."""
    link = next((v for k, v in headers.items() if k.lower() == "link"), "")
    match = re.search(r'<([^>]+)>\s*;\s*rel="?next"?', link)
    return match.group(1) if match else None


def _public_lookup(image: str, name: ImageName) -> ImageLookup | Unknown:
    base = PUBLIC_REGISTRY_URL.rstrip("/")
    scope = urllib.parse.quote(f"repository:{name.repository}:pull", safe=":/")
    try:
        status, _, body = _get(f"{base}/token/?service={PUBLIC_REGISTRY}&scope={scope}")
        if status != 200:
            return Unknown(f"{PUBLIC_REGISTRY}'s token endpoint answered HTTP {status}")
        token = json.loads(body)["token"]
        status, headers, _ = _get(f"{base}/v2/{name.repository}/manifests/{name.reference}", token, "HEAD")
        if status == 200:
            digest = next((v for k, v in headers.items() if k.lower() == "docker-content-digest"), "")
            return ImageLookup(image, True, digest=digest)
        if status != 404:
            return Unknown(f"{PUBLIC_REGISTRY} answered HTTP {status} for {name.repository}:{name.reference}")
        return _public_tags(image, name, base, token)
    except (OSError, ValueError, KeyError) as exc:
        return Unknown(f"{PUBLIC_REGISTRY} did not answer ({getattr(exc, 'reason', exc)})")


def _public_tags(image: str, name: ImageName, base: str, token: str) -> ImageLookup | Unknown:
    tags: list[str] = []
    url: str | None = f"{base}/v2/{name.repository}/tags/list?n=1000"
    for _ in range(MAX_TAG_PAGES):
        if url is None:
            break
        status, headers, body = _get(url, token)
        if status == 404:
            codes = {e.get("code") for e in json.loads(body or b"{}").get("errors", [])}
            return ImageLookup(image, False, repository_missing="NAME_UNKNOWN" in codes)
        if status != 200:
            return ImageLookup(image, False)  # absent all the same; its tags could not be listed
        tags += json.loads(body).get("tags") or []
        following = _next_page(headers)
        url = urllib.parse.urljoin(base + "/", following) if following else None
    return ImageLookup(image, False, tags=tuple(tags))


def _ecr_unknown(exc: Exception, call: str) -> Unknown:
    fatal = fatal_error(exc, call)
    if fatal is not None:
        return Unknown(f"{call}: {fatal.message}")
    if is_api_error(exc):
        return Unknown(f"{call}: {error_code(exc)}: {error_message(exc)}")
    raise exc


def _private_lookup(image: str, name: ImageName, account: str, region: str) -> ImageLookup | Unknown:
    client = Aws(region).client("ecr")
    image_id = {"imageDigest": name.digest} if name.digest else {"imageTag": name.tag}
    try:
        out = client.describe_images(registryId=account, repositoryName=name.repository, imageIds=[image_id])
        details = out.get("imageDetails") or []
        if details:
            return ImageLookup(image, True, digest=details[0]["imageDigest"])
    except Exception as exc:
        if error_code(exc) == "RepositoryNotFoundException":
            return ImageLookup(image, False, repository_missing=True)
        if error_code(exc) != "ImageNotFoundException":
            return _ecr_unknown(exc, "ecr:DescribeImages")
    try:
        pages = client.get_paginator("list_images").paginate(
            registryId=account, repositoryName=name.repository, filter={"tagStatus": "TAGGED"})
        tags = [i["imageTag"] for page in pages for i in page.get("imageIds", []) if i.get("imageTag")]
    except Exception as exc:
        if not is_api_error(exc):
            raise
        return ImageLookup(image, False)  # absent all the same; its tags could not be listed
    return ImageLookup(image, False, tags=tuple(sorted(set(tags))))


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
        return _ecr_unknown(exc, "ecr:DescribeImages")
    details = out.get("imageDetails") or []
    return details[0]["imageDigest"] if details else Unknown(f"ecr:DescribeImages: no image tagged {tag}")
