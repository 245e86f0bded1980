"""The spec files a user copies: each renders and validates, the jobs fit the clusters' S3 role, the docs document every key."""

from __future__ import annotations

import re
import runpy
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from trainlift.config.cluster import ClusterSpec, cluster_spec_from_yaml
from trainlift.config.job import load_job_spec
from trainlift.render import render_cluster
from trainlift.render.s3_access import job_s3_uses, s3_access_problems

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
docs_text = runpy.run_path(str(ROOT / "tests" / "docs_text.py"))["docs_text"]  # README.md and docs/*.md


def _is_cluster_spec(path: Path) -> bool:
    data = yaml.safe_load(path.read_text())
    return isinstance(data, dict) and "workers" in data


CLUSTERS = sorted(p for p in EXAMPLES.glob("*.yaml") if _is_cluster_spec(p))
JOBS = sorted(p for p in EXAMPLES.glob("*.yaml") if not _is_cluster_spec(p))


def test_there_is_a_p5_cluster_next_to_the_reference():
    types = {p.name: {w.instance_type for w in cluster_spec_from_yaml(p.read_text()).workers} for p in CLUSTERS}
    assert "cluster-reference.yaml" in types
    assert any("p5.48xlarge" in found for found in types.values())


@pytest.mark.parametrize("path", CLUSTERS, ids=lambda p: p.name)
def test_every_example_cluster_renders_and_validates(path):
    # render_cluster checks trainlift's rules, then every manifest against the eksctl, KubeRay and Kubernetes schemas.
    manifests = render_cluster(cluster_spec_from_yaml(path.read_text(), source=path.name))
    assert {"eksctl.yaml", "k8s/20-raycluster.yaml"} <= {m.path for m in manifests}


@pytest.mark.parametrize("cluster", CLUSTERS, ids=lambda p: p.name)
@pytest.mark.parametrize("job", [p for p in JOBS if "eks" in p.name], ids=lambda p: p.name)
def test_the_eks_jobs_use_only_what_the_clusters_role_covers(cluster, job):
    spec = cluster_spec_from_yaml(cluster.read_text())
    assert s3_access_problems(spec, job_s3_uses(load_job_spec(job))) == []


def _field_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    paths = []
    for name, field in model.model_fields.items():
        path, annotation = prefix + name, field.annotation
        many = typing.get_origin(annotation) is list
        if many:
            (annotation,) = typing.get_args(annotation)
        inner = [a for a in typing.get_args(annotation) or (annotation,) if isinstance(a, type)]
        nested = [a for a in inner if issubclass(a, BaseModel)]
        # A list of sections reads `workers[].name`; a list of values is documented by its own name.
        paths += _field_paths(nested[0], path + ("[]." if many else ".")) if nested else [path]
    return paths


def test_readme_documents_every_cluster_spec_key():
    readme = docs_text()
    documented = set(re.findall(r"`([a-z0-9_\[\].]+)`", readme))
    paths = _field_paths(ClusterSpec)
    assert "workers[].capacity_reservation_id" in paths and "storage.s3.read" in paths
    missing = [p for p in paths if p not in documented]
    assert missing == [], f"README.md and docs/*.md do not document {missing}"
