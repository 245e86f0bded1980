"""Volcano as the scheduler: KubeRay's batchScheduler value, a Queue that validates strictly, the queue label; and
what `cluster up` plans for each scheduler (scheduler: none plans nothing new)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trainlift import catalog
from trainlift.config.cluster import parse_cluster_spec
from trainlift.ops.plan import Files, Observed, plan_up
from trainlift.ops.placement import Placement
from trainlift.render import JobInputs, render_cluster
from trainlift.render.validate import crd_problems

ROOT = Path(__file__).resolve().parents[2]
JOB = JobInputs(name="sft", spec_path="jobs/sft.yaml", workers=8, working_dir="s3://my-trainlift-checkpoints/code/j.zip",
                trainlift_uri="s3://my-trainlift-checkpoints/code/trainlift.zip")
FILES = Files(".trainlift/c", raycluster_hash="h1")


def spec_data(example: str, **changes) -> dict:
    data = yaml.safe_load((ROOT / "examples" / example).read_text())
    data.update(changes)
    return data


def rendered(data: dict) -> dict:
    return {m.path: m for m in render_cluster(parse_cluster_spec(data), JOB)}


@pytest.mark.parametrize("example", ["cluster-reference.yaml", "cluster-p5.yaml"])
def test_volcano_queue_validates_and_holds_every_node_group(example):
    data = spec_data(example, scheduler="volcano")
    out = rendered(data)
    [queue] = [m.body for m in out.values() if isinstance(m.body, dict) and m.body.get("kind") == "Queue"]
    assert queue["apiVersion"] == "scheduling.volcano.sh/v1beta1" and crd_problems(queue) == []
    w = data["workers"][0]
    p, n = catalog.lookup(w["instance_type"]), w["count"]
    system = catalog.lookup(data["system"]["instance_type"])
    assert queue["spec"]["capability"]["nvidia.com/gpu"] == str(n * p.gpus)
    assert queue["spec"]["capability"]["cpu"] == str(n * p.vcpus + system.vcpus)
    assert queue["spec"]["capability"]["memory"] == f"{n * p.memory_mib + system.memory_mib}Mi"


def test_volcano_is_kuberays_batch_scheduler_and_installed_before_it():
    out = rendered(spec_data("cluster-p5.yaml", scheduler="volcano"))
    assert out["helm/kuberay-operator.values.yaml"].body["batchScheduler"] == {"name": "volcano"}
    names = [r["name"] for r in out["helm/releases.yaml"].body["releases"]]
    assert names.index("volcano") < names.index("kuberay-operator") and "kueue" not in names
    assert "--repo https://volcano-sh.github.io/helm-charts --version 1.15.1" in out["helm/volcano.values.yaml"].comment
    cluster = out["k8s/20-raycluster.yaml"].body
    assert cluster["metadata"]["labels"]["volcano.sh/queue-name"] == "ray-train-p5"
    assert "kueue.x-k8s.io/queue-name" not in cluster["metadata"]["labels"]


def test_scheduler_none_renders_no_queue_objects_or_labels():
    out = rendered(spec_data("cluster-p5.yaml", scheduler="none"))
    assert not [p for p in out if p.startswith("k8s/15-")]
    assert [r["name"] for r in out["helm/releases.yaml"].body["releases"]] == [
        "kuberay-operator", "nvidia-device-plugin", "aws-efa-k8s-device-plugin"]
    assert "batchScheduler" not in out["helm/kuberay-operator.values.yaml"].body
    job = out["k8s/30-rayjob.yaml"].body
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": "ray-train-p5"} and "backoffLimit" not in job["spec"]


def keys(data: dict) -> list[str]:
    spec = parse_cluster_spec(data)
    placed = {w.name: Placement(w.name, "us-east-2a", "pinned") for w in spec.workers}
    return [s.key for s in plan_up(spec, Observed.nothing(), placed, FILES).steps]


def commands(data: dict, key: str) -> list[str]:
    spec = parse_cluster_spec(data)
    placed = {w.name: Placement(w.name, "us-east-2a", "pinned") for w in spec.workers}
    return [op.text() for s in plan_up(spec, Observed.nothing(), placed, FILES).steps if s.key == key for op in s.ops]


def test_cluster_up_installs_kueue_then_applies_the_queues_before_the_raycluster():
    data = spec_data("cluster-p5.yaml")
    order = keys(data)
    assert order.index("helm/kuberay-operator") < order.index("helm/kueue") < order.index("queues") \
        < order.index("raycluster")
    kueue = commands(data, "helm/kueue")[0]
    assert kueue.startswith("helm upgrade --install kueue .trainlift/")
    assert "/charts/kueue-0.19.2.tgz --namespace kueue-system" in kueue
    assert "--wait" in kueue
    applied = commands(data, "queues")
    assert len(applied) == 5 and all("apply --server-side" in c and "/k8s/15-" in c for c in applied)


def test_cluster_up_with_scheduler_none_plans_nothing_new():
    order = keys(spec_data("cluster-p5.yaml", scheduler="none"))
    assert "queues" not in order and "helm/kueue" not in order and "helm/volcano" not in order


def test_cluster_up_with_volcano_installs_it_before_kuberay():
    order = keys(spec_data("cluster-p5.yaml", scheduler="volcano"))
    assert order.index("helm/volcano") < order.index("helm/kuberay-operator") < order.index("queues")
