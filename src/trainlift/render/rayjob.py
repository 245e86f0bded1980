"""A training job -> KubeRay RayJob running `python -m trainlift train <spec>` on the cluster.

Takes plain inputs, not the job spec model, so it works with any caller that
knows the job's name, where its spec file sits in the working dir, and its scale.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import yaml

from trainlift.config.cluster import ClusterSpec
from trainlift.errors import SpecError
from trainlift.render.eksctl import SYSTEM_LABELS
from trainlift.render.job_launch import job_entrypoint, job_runtime_env
from trainlift.render.queues import placement_annotations, queue_labels
from trainlift.render.raycluster import MANAGED_BY, image_ref, raycluster_spec, security_context

# KubeRay derives names of the RayCluster and submitter Job from the RayJob's.
MAX_NAME = 47


@dataclass(frozen=True)
class JobInputs:
    """name: the run's name; spec_path: the job spec's path inside the working dir;
    workers: Ray Train workers (None: one per GPU); overrides: `--set` values for `trainlift train`;
    working_dir: remote URI of the zipped project; trainlift_uri: remote URI of a zip holding the
    trainlift package folder (the image has no trainlift); pip: requirements the image lacks, installed by the
    runtime_env on every node (catalog.packages.runtime_pip). backoff_limit: new RayClusters KubeRay starts after a
    failed attempt (each retry resumes from the latest complete checkpoint); max_hours: the job's deadline."""

    name: str
    spec_path: str
    workers: int | None = None
    working_dir: str | None = None
    trainlift_uri: str | None = None
    shutdown_after_finish: bool = False
    overrides: tuple[str, ...] = ()
    pip: tuple[str, ...] = ()
    ttl_seconds_after_finished: int = 300
    submitter_backoff_limit: int = 2
    backoff_limit: int = 2
    max_hours: float | None = None


def k8s_name(name: str) -> str:
    """A DNS-1123 label made from a run name: lowercase, '-' for anything else, at most MAX_NAME."""
    cleaned = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:MAX_NAME].rstrip("-")
    if not cleaned or not cleaned[0].isalpha():
        cleaned = ("job-" + cleaned)[:MAX_NAME].rstrip("-")
    return cleaned


def job_problems(cluster: ClusterSpec, job: JobInputs) -> list[str]:
    problems = []
    if job.workers is not None and job.workers > cluster.gpu_count:
        problems.append(
            f"scaling.workers: {job.workers} workers need {job.workers} GPUs; "
            f"the cluster has {cluster.gpu_count}"
        )
    if job.working_dir is not None and "://" not in job.working_dir:
        problems.append(
            f"runtime_env.working_dir: {job.working_dir} is a local path; a RayJob submits from inside "
            "the cluster, so the working dir must be a remote URI (e.g. s3://bucket/code.zip)"
        )
    if job.trainlift_uri is None or "://" not in job.trainlift_uri:
        given = "no trainlift package is given" if job.trainlift_uri is None else \
            f"{job.trainlift_uri} is not a remote URI"
        problems.append(
            f"runtime_env.py_modules: {given}; the cluster's image has no trainlift, so ship it as a wheel: "
            "`trainlift package --upload s3://bucket/code/`"
        )
    if job.ttl_seconds_after_finished < 0:
        problems.append("ttl_seconds_after_finished: must be at least 0")
    if job.max_hours is not None and job.max_hours <= 0:
        problems.append(f"run.max_hours: must be more than 0 (got {job.max_hours})")
    return problems


def _submitter(cluster: ClusterSpec) -> dict[str, Any]:
    # KubeRay fills in the `ray job submit` command; this places the submitter on
    # the system nodes with a small footprint next to the head. It only posts the entrypoint and the runtime_env's
    # URIs to the head's Jobs API (Ray uploads nothing for a working_dir or py_modules that is already a remote URI:
    # ray/_private/runtime_env/working_dir.py, upload_working_dir_if_needed), so it touches no S3: it runs under the
    # namespace's default service account, not the S3 role's, without an API token (it never calls Kubernetes).
    # KubeRay gives it the head's Ray token (RAY_AUTH_TOKEN from the RayCluster's Secret).
    return {
        "metadata": {"labels": dict(MANAGED_BY)},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": dict(SYSTEM_LABELS),
            "automountServiceAccountToken": False,
            "containers": [{
                "name": "ray-job-submitter",
                "image": image_ref(cluster),
                "imagePullPolicy": cluster.image.pull_policy,
                "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}],
                "resources": {
                    "limits": {"cpu": "1", "memory": "1Gi"},
                    "requests": {"cpu": "200m", "memory": "512Mi"},
                },
                "securityContext": security_context(),
            }],
        },
    }


def render_rayjob(cluster: ClusterSpec, job: JobInputs) -> dict[str, Any]:
    """With shutdown_after_finish the RayJob brings its own RayCluster and deletes it at the end (queued, under a
    scheduler), and a failed attempt is retried backoff_limit times, each on a new RayCluster (KubeRay >= 1.2) that
    resumes from the latest complete checkpoint. Otherwise it runs on the RayCluster rendered from the same cluster
    spec (clusterSelector), which a retry would not replace, so it gets no backoffLimit; it carries no queue label:
    the standing RayCluster is what the queue admits (Kueue neither manages nor charges a RayJob with
    clusterSelector and no rayClusterSpec, kueue pkg/controller/jobs/rayjob/rayjob_webhook.go@v0.19.2)."""
    problems = job_problems(cluster, job)
    if problems:
        raise SpecError("; ".join(problems))
    own_cluster = job.shutdown_after_finish
    runtime_env = job_runtime_env(job.working_dir, [job.trainlift_uri] if job.trainlift_uri else [], pip=job.pip)
    spec: dict[str, Any] = {"entrypoint": job_entrypoint(job.spec_path, job.overrides)}
    spec["runtimeEnvYAML"] = yaml.safe_dump(runtime_env, sort_keys=True, default_flow_style=False)
    spec["submissionMode"] = "K8sJobMode"
    spec["submitterConfig"] = {"backoffLimit": job.submitter_backoff_limit}
    spec["submitterPodTemplate"] = _submitter(cluster)
    if own_cluster:
        spec["backoffLimit"] = job.backoff_limit
    if job.max_hours is not None:
        spec["activeDeadlineSeconds"] = math.ceil(job.max_hours * 3600)
    spec["shutdownAfterJobFinishes"] = own_cluster
    if own_cluster:
        spec["ttlSecondsAfterFinished"] = job.ttl_seconds_after_finished
        spec["rayClusterSpec"] = raycluster_spec(cluster, placement_annotations(cluster))
    else:
        spec["clusterSelector"] = {"ray.io/cluster": cluster.name}
    labels = {**MANAGED_BY, **(queue_labels(cluster) if own_cluster else {})}
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": k8s_name(job.name), "namespace": cluster.namespace, "labels": labels},
        "spec": spec,
    }
