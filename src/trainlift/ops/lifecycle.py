"""Cluster lifecycle: observe -> plan (pure, ops/plan.py) -> apply. Re-running continues where it stopped.

`prepare` observes EKS (cloud/aws.py; eksctl when the EKS API is not permitted) and
Kubernetes (ops/kube.py), checks capacity for each worker group still to be created,
pins AZs, renders every manifest and writes them under the cluster's directory
(default .trainlift/<name>/). `apply_plan.apply` then runs each step's operations in order;
its waits poll the same observations. Nothing here decides what to do: the plan does.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from trainlift.cloud.aws import Aws, CredentialsError, check_region
from trainlift.catalog.lookup import pinned_image
from trainlift.cloud import ecr
from trainlift.cloud.caller import public_cidr
from trainlift.cloud.capacity import CapacityReport, Unknown, assess
from trainlift.config.cluster import ClusterSpec
from trainlift.errors import SpecError, TrainliftError
from trainlift.ops import charts, kube
from trainlift.ops.eksctl import observe_with_eksctl
from trainlift.ops.pins import VERSION_ARGS, tool_version
from trainlift.ops.placement import Placement, allowed_zones, place, resolve_spec
from trainlift.ops.plan import ABSENT, Files, Observed
from trainlift.ops.plan_kube import PLUGIN_NAMESPACE
from trainlift.ops.preflight import TOOLS
from trainlift.ops.run import run as run_command
from trainlift.private_dir import private_dir
from trainlift.render.eksctl import SYSTEM_GROUP, image_pulls, open_endpoint_note, with_caller_address
from trainlift.render.cold_start import cold_start
from trainlift.render.helm import digest_line, render_helm_releases
from trainlift.render.image_cache import CACHE_PREFIX, with_account

DEFAULT_ROOT = ".trainlift"


@dataclass
class Prepared:
    spec: ClusterSpec
    seen: Observed
    reports: dict[str, CapacityReport]
    placements: dict[str, Placement]
    files: Files
    written: list[str]
    aws: Aws


def cluster_dir(spec: ClusterSpec, root: str | None) -> str:
    return root if root is not None else f"{DEFAULT_ROOT}/{spec.name}"


def private_cluster_dir(root: str) -> Path:
    """The cluster's directory, created 0700 (it holds the cluster's kubeconfig and its chart digests); one others
    may write is refused."""
    return private_dir(Path(root), elsewhere="pass --dir with a directory of yours")


def spec_hash(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


# --- observe -------------------------------------------------------------------------------------

def _write_kubeconfig(spec: ClusterSpec, info, files: Files) -> None:
    path = Path(files.kubeconfig)
    private_cluster_dir(str(path.parent))
    config = kube.kubeconfig_for(spec.name, spec.region, info.endpoint, info.ca_data)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    os.chmod(path, 0o600)


def _observe_kubernetes(spec: ClusterSpec, files: Files) -> dict:
    k = kube.Kube(files.kubeconfig)
    out: dict = {"unknown": {}}
    nodes = k.nodes()
    if isinstance(nodes, Unknown):
        out["unknown"]["kubernetes"] = nodes.reason
    else:
        out["nodes"] = tuple(nodes)
        namespaces = k.namespaces()
        out["namespace"] = None if isinstance(namespaces, Unknown) else spec.namespace in namespaces
        if out["namespace"]:
            for key, kind in (("service_accounts", "serviceaccounts"), ("secrets", "secrets")):
                found = k.names(kind, spec.namespace)
                out[key] = None if isinstance(found, Unknown) else found
            rc = k.raycluster(spec.namespace, spec.name)
            out["raycluster"] = None if isinstance(rc, Unknown) else rc
        elif out["namespace"] is False:
            out.update(service_accounts=frozenset(), secrets=frozenset(), raycluster=kube.RayState(exists=False))
    releases = k.releases()
    if isinstance(releases, Unknown):
        out["unknown"]["helm"] = releases.reason
    else:
        out["releases"] = releases
    if "kubernetes" not in out["unknown"]:
        daemonsets = k.daemonsets(PLUGIN_NAMESPACE)
        out["daemonsets"] = None if isinstance(daemonsets, Unknown) else daemonsets
    return out


def tools_on_path() -> dict[str, bool]:
    return {tool: shutil.which(tool) is not None for tool in TOOLS}


def observe_pins(spec: ClusterSpec, seen: Observed, root: str) -> dict:
    """The tools' versions, and each pinned chart version pulled into `<root>/charts/` with its digest and the
    digest it must have (`helm pull`; no cluster needed). A chart pinned by version only has its first digest
    recorded here."""
    found = seen.tools or {}
    versions = {}
    for tool, args in VERSION_ARGS.items():
        if found.get(tool):
            result = run_command([tool, *args], timeout=30)
            versions[tool] = tool_version(tool, result.stdout) if result.returncode == 0 else None
    if not found.get("helm"):
        return {"tool_versions": versions}
    found_charts, digests, pins, unknown = {}, {}, {}, {}
    for release in render_helm_releases(spec):
        pulled = charts.pull(release, root)
        if isinstance(pulled, str) and "not found" not in pulled:
            unknown["charts"] = f"{release['name']}: {pulled}"
            continue
        found_charts[release["name"]] = pulled if isinstance(pulled, str) else ""
        if isinstance(pulled, charts.PulledChart):
            digests[release["name"]] = pulled.digest
            pins[release["name"]] = charts.expected(release, root)
            if pins[release["name"]][0] is None:
                charts.record(root, release, pulled.digest)
    if unknown:
        return {"tool_versions": versions, "unknown": {**seen.unknown, **unknown}}
    return {"tool_versions": versions, "charts": found_charts, "chart_digests": digests, "chart_pins": pins}


def _observe_owner(spec: ClusterSpec, aws: Aws, exists: bool) -> dict:
    """The control plane stack eksctl left, and the tags that say who created the cluster."""
    out: dict = {"unknown": {}}
    stack = aws.cluster_stack(spec.name)
    if isinstance(stack, Unknown):
        out["unknown"]["stack"] = stack.reason
    else:
        out["stack"] = stack
    found = aws.cluster_tags(spec.name) if exists else None
    if isinstance(found, Unknown):
        out["unknown"]["tags"] = found.reason
    elif found is not None:
        out.update(tags=found.tags, cluster_arn=found.arn)
    elif out.get("stack") is not None:
        out["tags"] = out["stack"].tags
    return out


def _observe_network_policy(spec: ClusterSpec, aws: Aws, unknown: dict[str, str]) -> dict:
    """Whether the cluster's vpc-cni add-on enforces NetworkPolicy (its enableNetworkPolicy setting)."""
    found = aws.addon_configuration(spec.name, "vpc-cni")
    if isinstance(found, Unknown):
        unknown["vpc-cni"] = found.reason
        return {}
    try:
        values = json.loads(found) if found else {}
    except ValueError:
        values = {}
    return {"cni_network_policy": found is not None and str(values.get("enableNetworkPolicy")).lower() == "true"}


def _observe_group_stacks(spec: ClusterSpec, groups: dict, aws: Aws) -> dict:
    """eksctl's stack of each group of the spec that EKS does not list: a stack a failed create left makes
    `eksctl create nodegroup` skip the group."""
    absent = [name for name in (SYSTEM_GROUP, *(w.name for w in spec.workers)) if name not in groups]
    found = aws.nodegroup_stacks(spec.name, absent) if absent else {}
    if isinstance(found, Unknown):
        return {"unknown": {"nodegroup-stacks": found.reason}}
    return {"nodegroup_stacks": found, "unknown": {}}


def observe(spec: ClusterSpec, files: Files, aws: Aws) -> Observed:
    seen = _observe(spec, files, aws)
    owner = _observe_owner(spec, aws, exists=seen.control_plane not in (None, ABSENT))
    if seen.control_plane not in (None, ABSENT):
        owner.update(_observe_network_policy(spec, aws, owner["unknown"]))
    if spec.image.cache == "ecr":
        rule = aws.pull_through_rule(CACHE_PREFIX)
        if isinstance(rule, Unknown):
            owner["unknown"]["image-cache"] = rule.reason
        else:
            owner["cache_rule"] = rule or ""
    return replace(seen, tools=tools_on_path(), unknown={**seen.unknown, **owner.pop("unknown")}, **owner)


def upstream_image(spec: ClusterSpec) -> str:
    """The image the pods run, as its own registry names it: a floating catalog tag as the release it stands for (an
    ECR pull-through cache fetches it from there on the first pull, so it is the upstream that must have it)."""
    return pinned_image(spec.image.uri) or spec.image.uri


def observe_image(spec: ClusterSpec, seen: Observed) -> Observed:
    """What the image's registry says about the image the pods will pull (cloud/ecr.py), before anything bills."""
    found = ecr.check_image(upstream_image(spec))
    if isinstance(found, Unknown):
        return replace(seen, unknown={**seen.unknown, "image": found.reason})
    return replace(seen, image=found)


def _observe(spec: ClusterSpec, files: Files, aws: Aws) -> Observed:
    unknown: dict[str, str] = {}
    try:
        info = aws.cluster(spec.name)
        groups = aws.nodegroups(spec.name) if info is not None else {}
    except CredentialsError:
        raise
    except TrainliftError as exc:
        info, groups = observe_with_eksctl(spec.name, spec.region)
        if isinstance(info, Unknown):
            unknown["eks"] = f"{exc.message}; {info.reason}"
            return Observed(None, None, unknown=unknown)
    if info is None:
        return Observed.nothing()
    if isinstance(groups, Unknown):
        unknown["eks"] = groups.reason
        groups = None
    stacks = _observe_group_stacks(spec, groups, aws) if groups is not None else {"unknown": {}}
    unknown.update(stacks.pop("unknown"))
    fields: dict = {}
    if info.status in ("ACTIVE", "UPDATING") and info.endpoint and info.ca_data:
        _write_kubeconfig(spec, info, files)
        fields = _observe_kubernetes(spec, files)
        unknown.update(fields.pop("unknown"))
    elif info.status in ("ACTIVE", "UPDATING"):
        unknown["kubernetes"] = "the API server's endpoint is unknown (eks:DescribeCluster was not readable)"
    else:
        unknown["kubernetes"] = f"the control plane is {info.status}"
    return Observed(info.status, groups, unknown=unknown, api_cidrs=info.public_access_cidrs, **stacks, **fields)


# --- prepare -------------------------------------------------------------------------------------

def _capacity(spec: ClusterSpec, seen: Observed, aws: Aws) -> tuple[dict[str, CapacityReport], list[str]]:
    reports: dict[str, CapacityReport] = {}
    facts_by_type: dict[tuple[str, int], object] = {}
    zones: list[str] = []
    for w in spec.workers:
        if seen.nodegroups is not None and w.name in seen.nodegroups:
            continue
        key = (w.instance_type, w.count)
        if key not in facts_by_type:
            facts_by_type[key] = aws.capacity(w.instance_type, w.count)
        facts = facts_by_type[key]
        zones = list(facts.zones)  # type: ignore[attr-defined]
        reports[w.name] = assess(facts, allowed_zones(spec, w.name))  # type: ignore[arg-type]
    return reports, zones


def _render(spec: ClusterSpec, root: str, write: bool, reservations: dict | None = None) -> tuple[Files, list[str]]:
    from trainlift.render import admissions, pod_placements, render_cluster

    manifests, written = [], []
    digest, account = "", False
    rendered = render_cluster(spec, reservations=reservations)
    cidrs = ", ".join(spec.api_access_cidrs)
    scheduling = tuple([f"fits   {p.line()}" for p in pod_placements(spec, rendered)]
                       + [f"queue  {line}" for line in admissions(rendered)]
                       + [f"api    {open_endpoint_note(spec) or 'EKS API public endpoint: only from ' + cidrs}"]
                       + [f"chart  {digest_line(release)}" for release in render_helm_releases(spec)]
                       + [f"pull   {line}" for line in image_pulls(spec).values()]
                       + [f"wait   {line}" for line in cold_start(spec).lines()])
    for m in rendered:
        if m.kind == "RayCluster":
            digest = spec_hash(m.body)
            body = json.loads(json.dumps(m.body))
            body["metadata"].setdefault("annotations", {})[kube.SPEC_HASH] = digest
            m = replace(m, body=body)
        account = account or m.kind == "ServiceAccount"
        manifests.append(m)
    if write:
        private_cluster_dir(root)
        for m in manifests:
            target = Path(root) / m.path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(m.text())
            written.append(str(target))
    return Files(root, digest, account, scheduling), written


def _render_or_nothing(spec: ClusterSpec, root: str, write: bool, tolerate: bool,
                       reservations: dict | None = None) -> tuple[Files, list[str]]:
    try:
        return _render(spec, root, write, reservations)
    except SpecError:
        if not tolerate:
            raise
        return Files(root), []


def _without_credentials(spec: ClusterSpec, root: str, write: bool, aws: Aws, why: str, for_up: bool) -> Prepared:
    """A dry run without AWS credentials: planned as if nothing existed, saying so on every step."""
    seen = replace(Observed.nothing(assumed=why), tools=tools_on_path())
    if not for_up:
        return Prepared(spec, seen, {}, {}, Files(root), [], aws)
    placements = {name: replace(p, reason=f"{p.reason}: {why}") for name, p in place(spec, {}, None).items()}
    resolved = resolve_spec(spec, placements, list(spec.availability_zones), None)
    files, written = _render_or_nothing(resolved, root, write, tolerate=True)
    return Prepared(resolved, replace(seen, **observe_pins(spec, seen, root)), {}, placements, files, written, aws)


def prepare(spec: ClusterSpec, root: str | None = None, write: bool = True, aws: Aws | None = None,
            for_up: bool = True, need_credentials: bool = True) -> Prepared:
    """Observe, check capacity, pin AZs, render (and write) the files: everything a plan needs.

    `for_up=False` (down) only observes: nothing is created, so nothing is placed or rendered.
    `need_credentials=False` (dry runs): without AWS credentials, plan as if nothing existed.
    """
    check_region(spec.region)
    aws = aws or Aws(spec.region)
    root = cluster_dir(spec, root)
    try:
        spec = with_account(spec, aws.identity()["account"])
    except CredentialsError as exc:
        if need_credentials:
            raise
        return _without_credentials(spec, root, write, aws, f"not looked up: {exc.message}", for_up)
    seen = observe(spec, Files(root), aws)
    if not for_up:
        return Prepared(spec, seen, {}, {}, Files(root), [], aws)
    seen = observe_image(spec, seen)
    if not spec.api_access_cidrs:  # only this machine reaches the API's public endpoint (api_access_cidrs)
        found = public_cidr()
        spec = with_caller_address(spec, found if isinstance(found, str) else None)
    reports, zones = _capacity(spec, seen, aws)
    placements = place(spec, reports, seen.nodegroups)
    if not zones and not spec.availability_zones:
        zones = list(aws.zones())
    system = None
    if not spec.availability_zones:
        offered = aws.offered_zones(spec.system.instance_type)
        system = None if isinstance(offered, Unknown) else offered
    resolved = resolve_spec(spec, placements, zones, system)
    # What EC2 says about each reservation: render checks the group against it, and a Capacity Block not yet
    # active keeps its group at 0 nodes.
    seen = replace(seen, reservations={w.capacity_reservation_id: aws.reservation(w.capacity_reservation_id)
                                       for w in spec.workers if w.capacity_reservation_id}, **observe_pins(spec, seen, root))
    files, written = _render_or_nothing(resolved, root, write, any(p.blocking for p in placements.values()),
                                        seen.reservations)
    return Prepared(resolved, seen, reports, placements, files, written, aws)
