"""Pure spec -> manifests: eksctl, Helm, Kueue/Volcano queues, RayCluster, RayJob. Validated before anyone writes them.

`render_cluster(spec)` checks trainlift's rules, renders every manifest, validates each
against its schema, and returns them with the relative paths they belong at. Nothing
here touches the file system beyond the packaged schemas; the caller writes. Facts the
caller looked up (capacity reservations) and the S3 URIs the job uses are checked too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Literal

import yaml

from trainlift.config.cluster import ClusterSpec
from trainlift.render import admission
from trainlift.errors import SpecError
from trainlift.render.eksctl import Reservations, block_active, open_endpoint_note, render_eksctl
from trainlift.render.fit import Placement, fit_problems, placements
from trainlift.render.helm import install_commands, render_helm_releases
from trainlift.render.network_policy import NETWORK_POLICY_PATH, render_network_policy
from trainlift.render.problems import raise_problems
from trainlift.render.queues import placement_annotations, queue_labels, queue_object_path, queue_objects
from trainlift.render.raycluster import MANAGED_BY, image_ref, render_raycluster  # noqa: F401  (image_ref: for the CLI)
from trainlift.render.rayjob import JobInputs, render_rayjob
from trainlift.render.rules import cluster_problems, reservation_problems
from trainlift.render.s3_access import S3Use, runtime_env_s3_uses, s3_access_problems
from trainlift.render.validate import core_problems, crd_problems, eksctl_problems, values_problems

Check = Literal["eksctl", "crd", "core", "helm-values", "none"]
MAX_LISTED = 5

__all__ = ["JobInputs", "Manifest", "S3Use", "admission", "admissions", "pod_placements", "render_cluster",
           "render_manifests", "to_yaml",
           "validate_manifests"]


@dataclass(frozen=True)
class Manifest:
    path: str
    body: Any
    check: Check
    comment: str = ""

    @property
    def kind(self) -> str:
        if isinstance(self.body, dict) and "kind" in self.body:
            return self.body["kind"]
        return "HelmValues" if self.check == "helm-values" else "HelmReleases"

    def text(self) -> str:
        header = "".join(f"# {line}\n" for line in self.comment.splitlines())
        return header + to_yaml(self.body)


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(body: Any) -> str:
    """Block-style YAML in the renderers' own key order (multi-line strings as literal blocks)."""
    return yaml.dump(body, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)


def _namespace(spec: ClusterSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": spec.namespace, "labels": dict(MANAGED_BY)},
    }


def _service_account(spec: ClusterSpec) -> dict[str, Any] | None:
    """The storage service account, rendered here only for an existing role (else eksctl creates it)."""
    s3 = spec.storage.s3 if spec.storage else None
    if s3 is None or s3.role_arn is None:
        return None
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {
            "name": s3.service_account,
            "namespace": spec.namespace,
            "labels": dict(MANAGED_BY),
            "annotations": {"eks.amazonaws.com/role-arn": s3.role_arn},
        },
    }


def _helm_manifests(spec: ClusterSpec) -> list[Manifest]:
    releases = render_helm_releases(spec)
    index, manifests = [], []
    for release in releases:
        values_file = f"{release['name']}.values.yaml"
        entry = {k: v for k, v in release.items() if k != "values"}
        entry["valuesFile"] = values_file
        index.append(entry)
        command = install_commands(release, f"helm/{values_file}")
        manifests.append(Manifest(f"helm/{values_file}", release["values"], "helm-values", command))
    head = Manifest("helm/releases.yaml", {"releases": index}, "none", "Install in this order.")
    return [head] + manifests


def _eksctl_comment(spec: ClusterSpec, reservations: Reservations | None) -> str:
    lines = ["eksctl create cluster -f eksctl.yaml"]
    if note := open_endpoint_note(spec):
        lines.append(note)
    for w in spec.workers:
        if w.capacity_block and not block_active(w, reservations):
            lines.append(f"{w.name}: 0 nodes until Capacity Block {w.capacity_reservation_id} is active; then "
                         f"eksctl scale nodegroup --cluster {spec.name} --name {w.name} --nodes {w.count} "
                         f"--region {spec.region}")
    return "\n".join(lines)


def render_manifests(spec: ClusterSpec, job: JobInputs | None = None,
                     reservations: Reservations | None = None) -> list[Manifest]:
    """Every manifest for the spec, unvalidated (render_cluster validates)."""
    k8s = "kubectl apply -f k8s/  (after the Helm releases)"
    manifests = [Manifest("eksctl.yaml", render_eksctl(spec, reservations), "eksctl",
                          _eksctl_comment(spec, reservations))]
    manifests += _helm_manifests(spec)
    manifests.append(Manifest("k8s/00-namespace.yaml", _namespace(spec), "core", k8s))
    manifests.append(Manifest(NETWORK_POLICY_PATH, render_network_policy(spec), "core", k8s))
    account = _service_account(spec)
    if account is not None:
        manifests.append(Manifest("k8s/10-serviceaccount.yaml", account, "core", k8s))
    manifests += [Manifest(queue_object_path(i, obj), obj, "crd", k8s) for i, obj in enumerate(queue_objects(spec))]
    raycluster = render_raycluster(spec, queue_labels(spec), placement_annotations(spec))
    manifests.append(Manifest("k8s/20-raycluster.yaml", raycluster, "crd", k8s))
    if job is not None:
        manifests.append(Manifest("k8s/30-rayjob.yaml", render_rayjob(spec, job), "crd", k8s))
    return manifests


def validate_manifests(manifests: list[Manifest], kubernetes_version: str) -> None:
    """SpecError listing every schema problem (path in the output, then field path); None when all fit."""
    problems: list[str] = []
    for m in manifests:
        if m.check == "eksctl":
            found = eksctl_problems(m.body)
        elif m.check == "crd":
            found = crd_problems(m.body)
        elif m.check == "core":
            found = core_problems(m.body, kubernetes_version)
        elif m.check == "helm-values":
            found = values_problems(m.body, kubernetes_version)
        else:
            found = []
        problems += [f"{m.path}: {p}" for p in found]
    if problems:
        more = len(problems) - MAX_LISTED
        raise SpecError(
            "; ".join(problems[:MAX_LISTED]) + (f" (and {more} more)" if more > 0 else ""),
            hint="a rendered manifest does not fit its schema; check the spec fields it came from",
        )


def render_cluster(spec: ClusterSpec, job: JobInputs | None = None, *, s3_uses: Iterable[S3Use] = (),
                   reservations: Reservations | None = None) -> list[Manifest]:
    """Rules, render, validate: the manifests come back only when every check passed.

    `s3_uses`: S3 URIs the job spec reads and writes (`s3_access.job_s3_uses`); with the RayJob's
    runtime_env zips they must fall inside the pods' S3 role. `reservations`: what EC2 says about
    the worker groups' capacity reservations (`Aws.reservation`), checked against each group and
    used to size Capacity Block groups.
    """
    uses = list(s3_uses) + (runtime_env_s3_uses(job.working_dir, [job.trainlift_uri]) if job else [])
    raise_problems(cluster_problems(spec) + reservation_problems(spec, reservations or {})
                   + s3_access_problems(spec, uses))
    manifests = render_manifests(spec, job, reservations)
    validate_manifests(manifests, spec.kubernetes_version)
    raise_problems(fit_problems(pod_placements(spec, manifests)))
    queue, workloads = _queued(manifests)
    if queue is not None:
        raise_problems(admission.admit(queue, workloads))
    return manifests


def _queued(manifests: list[Manifest]) -> tuple[admission.Queue | None, list[admission.Workload]]:
    bodies = [(m.path, m.body) for m in manifests]
    return admission.cluster_queue(bodies), admission.queued_workloads(bodies)


def admissions(manifests: list[Manifest]) -> list[str]:
    """What each workload Kueue queues takes of the ClusterQueue, admitted in apply order (none without Kueue)."""
    queue, workloads = _queued(manifests)
    if queue is None:
        return []
    admission.admit(queue, workloads)
    return admission.admission_lines(queue, workloads) + admission.unqueued_lines([(m.path, m.body) for m in manifests])


def pod_placements(spec: ClusterSpec, manifests: list[Manifest]) -> list[Placement]:
    """Each Ray pod of the rendered RayCluster on a node of its group, with what it needs and what is left there."""
    raycluster = next(m.body for m in manifests if m.kind == "RayCluster")
    return placements(spec, raycluster["spec"])
