"""Scheduling on paper: each rendered Ray pod against a node's allocatable as EKS's AL2023 nodes compute it, after
what lands there first. The figures are the ones checked in the sources catalog/scheduling.yaml names (no Kubernetes
API server runs here); the two defects a field report found in the reference render are reproduced and refused."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from pathlib import Path

import pytest
import yaml

from trainlift import catalog
from trainlift.config.cluster import cluster_spec_from_yaml
from trainlift.errors import SpecError
from trainlift.render import fit, render_cluster
from trainlift.render.raycluster import raycluster_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str):
    return cluster_spec_from_yaml((EXAMPLES / name).read_text())


def test_allocatable_is_what_eks_al2023_nodes_report():
    """kube-reserved 80m/893Mi on m7i.xlarge and 190m/2829Mi on g6.12xlarge (nodeadm), 7.5% VM overhead, 100Mi
    eviction."""
    assert fit.allocatable(catalog.lookup("m7i.xlarge")) == fit.Amount(3920, 14162)
    assert fit.kube_reserved_cpu_m(48) == 190
    g6 = catalog.lookup("g6.12xlarge")
    assert fit.allocatable(g6) == fit.Amount(47810, 196608 * 925 // 1000 - 2829 - 100)
    assert fit.hugepage_pool_mib(g6, efa=True) == (55 * 48 + 1) * 2  # efa-config's pool, 55 x vCPUs + 1 pages


def test_what_lands_on_the_system_node_first_depends_on_the_scheduler():
    kueue = fit.landed_first(example("cluster-reference.yaml"), system=True)
    assert kueue["kueue-controller-manager"] == fit.Amount(500, 512) and kueue["coredns"] == fit.Amount(200, 140)
    # 925m the field report counted, metrics-server, submitter, aws-node's network policy agent (25m) and the margin
    # for one more DaemonSet (100m)
    assert sum(kueue.values(), fit.Amount(0, 0)).cpu_m == 1350
    plain = example("cluster-reference.yaml").model_copy(update={"scheduler": "none"})
    assert "kueue-controller-manager" not in fit.landed_first(plain, system=True)
    assert set(fit.landed_first(plain, system=False)) == {"kube-proxy", "aws-node", "one-more-daemonset",
                                                         "nvidia-device-plugin", "aws-efa-k8s-device-plugin"}


@pytest.mark.parametrize("name", ["cluster-reference.yaml", "cluster-p5.yaml"])
def test_the_examples_render_with_every_pod_placed(name):
    spec = example(name)
    found = fit.placements(spec, raycluster_spec(spec))
    assert [p.pod for p in found][0] == "ray-head" and len(found) == 1 + len(spec.workers)
    assert all(p.fits for p in found), [p.line() for p in found]
    assert fit.fit_problems(found) == []


def test_the_field_reports_head_and_worker_are_refused_with_the_numbers():
    """The reference render before this check: a head of 3 CPUs on the m7i.xlarge beside Kueue and the add-ons
    (3,925m+ on 3,920m), a worker of 172Gi on a g6.12xlarge (~169.6 GiB left)."""
    spec = example("cluster-reference.yaml")
    before = copy.deepcopy(raycluster_spec(spec))
    before["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "3"
    before["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["requests"]["memory"] = "172Gi"
    problems = [p.line() for p in fit.fit_problems(fit.placements(spec, before))]
    assert len(problems) == 2
    assert problems[0].startswith("system: the ray-head pod does not fit a m7i.xlarge node (CPU): it requests "
                                  "3000m CPU") and "2570m CPU" in problems[0]
    assert "ray-worker (gpu-workers) pod does not fit a g6.12xlarge node (memory)" in problems[1]
    assert "176128 MiB" in problems[1] and "173503 MiB" in problems[1]  # less the EFA plugin and the margin


def test_render_refuses_a_pod_that_cannot_fit_in_one_line(monkeypatch):
    from trainlift.render import raycluster

    spec = example("cluster-reference.yaml")
    roomy = fit.Amount(10**6, 10**8)
    # sizing as if nodes were endless (the check itself still reads the real figures)
    monkeypatch.setattr(raycluster, "fit", SimpleNamespace(room=lambda *a, **k: roomy))
    with pytest.raises(SpecError) as err:
        render_cluster(spec)
    assert "the ray-head pod does not fit a m7i.xlarge node" in err.value.one_line()
    assert "\n" not in err.value.one_line() and "choose a larger instance type" in err.value.one_line()


def test_render_prints_where_each_pod_lands(tmp_path):
    from typer.testing import CliRunner

    from trainlift.cli import app

    result = CliRunner().invoke(app, ["render", str(EXAMPLES / "cluster-reference.yaml"), "--check", "--json"])
    assert result.exit_code == 0, result.output
    placed = {p["pod"]: p for p in yaml.safe_load(result.stdout)["placement"]}
    assert placed["ray-head"]["fits"] and placed["ray-head"]["cpu_m"] <= placed["ray-head"]["cpu_m_left"]
    assert placed["ray-worker (gpu-workers)"]["memory_mib"] == 169 * 1024
