"""trainlift's own rules on a cluster spec: what no schema can say. Pure; each problem names its field path."""

from __future__ import annotations

import re

from trainlift import catalog
from trainlift.cloud.capacity import ENDED, Reservation
from trainlift.config.cluster import ClusterSpec, WorkerGroup
from trainlift.render.eksctl import RESERVED_LABELS, SYSTEM_GROUP, Reservations
from trainlift.render.kueue import queue_problems
from trainlift.render.image_cache import cache_problems
from trainlift.redact import credential_kind, has_credentials, secret_name, secret_value
from trainlift.render.problems import Problem, raise_problems
from trainlift.render.raycluster import TOKEN_AUTH_MIN_KUBERAY, TOKEN_AUTH_MIN_RAY
from trainlift.render.s3_access import location_problems



def _version(text: str | None) -> tuple[int, ...]:
    """'2.58.0' -> (2, 58, 0); () when it does not start with a number."""
    match = re.match(r"(\d+(?:\.\d+)*)", text or "")
    return tuple(int(p) for p in match.group(1).split(".")) if match else ()


def looks_secret(name: str, value: str) -> bool:
    """An environment variable whose name or value says it holds a credential (redact.py's detector)."""
    return bool(value) and (secret_name(name) or secret_value(value))


def _worker_problems(spec: ClusterSpec) -> list[Problem]:
    problems: list[Problem] = []
    efa = spec.fabric == "efa"
    efa_types = [t for t in catalog.instance_types(gpu=True) if catalog.lookup(t).efa_supported]
    seen: dict[str, int] = {}
    efa_az: tuple[int, str] | None = None
    for i, w in enumerate(spec.workers):
        at, profile = f"workers[{i}]", w.profile
        if w.name in seen or w.name == SYSTEM_GROUP:
            other = f"workers[{seen[w.name]}]" if w.name in seen else "the system node group"
            problems.append(Problem(f"{at}.name", f"{w.name!r} is already the name of {other}"))
        seen.setdefault(w.name, i)
        if efa and not profile.efa_supported:
            problems.append(Problem(
                f"{at}.instance_type", f"fabric is efa but {w.instance_type} has no EFA",
                hint="set fabric: socket, or use an EFA type: " + ", ".join(efa_types),
            ))
        if w.gpus is not None and w.gpus > profile.gpus:
            problems.append(Problem(
                f"{at}.gpus", f"{w.gpus} GPUs per worker but {w.instance_type} has {profile.gpus}",
                hint=f"at most {profile.gpus}, or leave gpus unset to take all of them",
            ))
        for az in w.availability_zones:
            if not re.fullmatch(re.escape(spec.region) + r"[a-z]", az):
                problems.append(Problem(f"{at}.availability_zones", f"{az} is not an AZ of {spec.region}"))
            elif spec.availability_zones and az not in spec.availability_zones:
                problems.append(Problem(
                    f"{at}.availability_zones", f"{az} is not one of the cluster's availability_zones",
                    hint=f"add {az} to availability_zones",
                ))
        if efa and profile.efa_supported:
            azs = w.availability_zones
            if len(azs) != 1:
                what = f"spans {len(azs)} AZs ({', '.join(azs)})" if azs else "sets no AZ"
                problems.append(Problem(
                    f"{at}.availability_zones",
                    f"an EFA node group needs exactly one AZ (EFA traffic does not cross AZs); this one {what}",
                    hint=f"keep one AZ where {w.instance_type} is offered "
                    f"(trainlift capacity {w.instance_type} --region {spec.region})",
                ))
            elif efa_az is None:
                efa_az = (i, azs[0])
            elif azs[0] != efa_az[1]:
                problems.append(Problem(
                    f"{at}.availability_zones",
                    f"EFA groups must share one AZ: {azs[0]} here, {efa_az[1]} in workers[{efa_az[0]}]",
                ))
        for key in w.labels:
            if key in RESERVED_LABELS:
                problems.append(Problem(f"{at}.labels.{key}", "is set by trainlift; choose another label"))
    return problems


def _cluster_problems(spec: ClusterSpec) -> list[Problem]:
    problems: list[Problem] = []
    pinned = sorted({az for w in spec.workers for az in w.availability_zones})
    if spec.availability_zones and len(set(spec.availability_zones)) < 2:
        problems.append(Problem("availability_zones", "EKS needs at least two AZs for the cluster"))
    elif pinned and not spec.availability_zones:
        problems.append(Problem(
            "availability_zones",
            f"worker groups pin {', '.join(pinned)}, so list the cluster's AZs: at least two of "
            f"{spec.region}, including those",
        ))
    for az in spec.availability_zones:
        if not re.fullmatch(re.escape(spec.region) + r"[a-z]", az):
            problems.append(Problem("availability_zones", f"{az} is not an AZ of {spec.region}"))
    image = spec.image
    known = catalog.image_ray_version(image.uri)
    if known is not None and image.ray_version != known:
        problems.append(Problem("image.ray_version", f"{image.ray_version}, but {image.uri} ships Ray {known}"))
    if () < _version(spec.ray_version) < _version(TOKEN_AUTH_MIN_RAY):
        problems.append(Problem(
            "ray_version", f"{spec.ray_version} has no token authentication (Ray {TOKEN_AUTH_MIN_RAY} or later), which "
            "the rendered RayCluster turns on so that only holders of its token reach the head",
            hint=f"use an image with Ray {TOKEN_AUTH_MIN_RAY} or later",
        ))
    if () < _version(spec.versions.kuberay.lstrip("v")) < _version(TOKEN_AUTH_MIN_KUBERAY):
        problems.append(Problem(
            "versions.kuberay", f"{spec.versions.kuberay} has no RayCluster authOptions (KubeRay "
            f"{TOKEN_AUTH_MIN_KUBERAY} or later), with which the rendered RayCluster requires Ray's token",
            hint=f"pin KubeRay {TOKEN_AUTH_MIN_KUBERAY} or later, or drop versions.kuberay to take the default",
        ))
    if spec.ray_version != image.ray_version:
        problems.append(Problem(
            "ray_version", f"{spec.ray_version} differs from the image's Ray {image.ray_version} ({image.uri})",
            hint="rayVersion must be the Ray inside the image; drop ray_version to take the image's",
        ))
    return problems


def _secret_problems(spec: ClusterSpec) -> list[Problem]:
    problems: list[Problem] = []
    for i, ref in enumerate(spec.secrets):
        if ref.value is not None:
            problems.append(Problem(
                f"secrets[{i}].value", "secret value written inline; reference a Kubernetes Secret instead",
                hint=f"kubectl -n {spec.namespace} create secret generic {ref.secret} "
                f"--from-literal={ref.key}=..., then remove value",
            ))
        if ref.env in spec.env:
            problems.append(Problem(f"secrets[{i}].env", f"{ref.env} is also set in env"))
    names = [ref.env for ref in spec.secrets]
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(Problem(f"secrets[{names.index(name)}].env", f"{name} is filled by more than one secret"))
    for name, value in spec.env.items():
        if credential_kind(value) == "uri":  # the value is not echoed: it is the thing being protected
            problems.append(Problem(
                f"env.{name}", "holds a URI with credentials (user:password@), which the RayCluster and every pod's "
                "spec would show",
                hint=f"drop user:password@ from the URI and give the credential through a Kubernetes Secret: "
                f"secrets: [{{env: NAME, secret: SECRET, key: KEY}}] (a secretKeyRef), created with kubectl -n "
                f"{spec.namespace} create secret generic SECRET --from-literal=KEY=...",
            ))
        elif looks_secret(name, value) or has_credentials(value):
            problems.append(Problem(
                f"env.{name}", "looks like a secret value written inline",
                hint=f"store it in a Kubernetes Secret and list it under secrets: "
                f"[{{env: {name}, secret: NAME, key: KEY}}]",
            ))
    return problems


def _storage_problems(spec: ClusterSpec) -> list[Problem]:
    s3 = spec.storage.s3 if spec.storage else None
    return location_problems(s3) if s3 is not None else []


def _reservation_spec_problems(spec: ClusterSpec) -> list[Problem]:
    problems: list[Problem] = []
    for i, w in enumerate(spec.workers):
        if w.capacity_block and not w.capacity_reservation_id:
            problems.append(Problem(
                f"workers[{i}].capacity_block", "needs capacity_reservation_id (the block's cr-... id)",
                hint=f"aws ec2 describe-capacity-reservations --region {spec.region} "
                "--filters Name=reservation-type,Values=capacity-block",
            ))
        elif w.capacity_reservation_id and len(w.availability_zones) != 1:
            where = f"spans {', '.join(w.availability_zones)}" if w.availability_zones else "sets no AZ"
            problems.append(Problem(
                f"workers[{i}].availability_zones",
                f"a group on capacity reservation {w.capacity_reservation_id} must sit in the reservation's AZ "
                f"and only there; this one {where}",
                hint=f"set availability_zones: [<AZ of {w.capacity_reservation_id}>] "
                f"(trainlift capacity {w.instance_type} --region {spec.region} lists it)",
            ))
    return problems


def _facts_problems(i: int, w: WorkerGroup, r: Reservation) -> list[Problem]:
    at, rid = f"workers[{i}]", r.id
    problems: list[Problem] = []
    if r.instance_type and r.instance_type != w.instance_type:
        problems.append(Problem(f"{at}.capacity_reservation_id",
                                f"{rid} reserves {r.instance_type}; this group runs {w.instance_type}"))
    if r.is_block and not w.capacity_block:
        problems.append(Problem(f"{at}.capacity_block", f"{rid} is a Capacity Block; set capacity_block: true",
                                hint="instances in a Capacity Block launch only with market type capacity-block"))
    elif w.capacity_block and not r.is_block:
        problems.append(Problem(f"{at}.capacity_block", f"{rid} is an On-Demand Capacity Reservation, "
                                "not a Capacity Block; drop capacity_block"))
    if w.availability_zones and w.availability_zones != [r.zone]:
        problems.append(Problem(
            f"{at}.availability_zones",
            f"{rid} is in {r.zone}; this group is in {', '.join(w.availability_zones)}, where it cannot launch",
            hint=f"set {at}.availability_zones: [{r.zone}] and keep {r.zone} in the cluster's availability_zones",
        ))
    if r.state in ENDED:
        problems.append(Problem(f"{at}.capacity_reservation_id", f"{rid} is {r.state}; nothing can launch in it"))
    elif r.total and w.count > r.total:
        problems.append(Problem(f"{at}.count", f"{rid} holds {r.total} instance(s); count is {w.count}",
                                hint=f"set count: {r.total} or reserve more"))
    return problems


def reservation_problems(spec: ClusterSpec, reservations: Reservations) -> list[Problem]:
    """What EC2's facts about each group's reservation rule out: another AZ, type or kind, an end, too few."""
    problems: list[Problem] = []
    for i, w in enumerate(spec.workers):
        found = reservations.get(w.capacity_reservation_id or "")
        if isinstance(found, Reservation):
            problems += _facts_problems(i, w, found)
    return problems


def cluster_problems(spec: ClusterSpec) -> list[Problem]:
    """Every rule the spec breaks, worker groups first (their problems are usually the cause)."""
    return (_worker_problems(spec) + _reservation_spec_problems(spec) + _cluster_problems(spec) + _secret_problems(spec)
            + _storage_problems(spec) + queue_problems(spec) + cache_problems(spec))


def check_cluster(spec: ClusterSpec) -> None:
    raise_problems(cluster_problems(spec))
