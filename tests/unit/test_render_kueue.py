"""Kueue objects for the reference cluster, a p5.48xlarge and a p4d.24xlarge variant: strict schema validation,
quotas equal to the node groups' totals, EKS's topology labels, and a RayCluster and RayJob Kueue's webhook accepts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trainlift import catalog
from trainlift.config.cluster import cluster_spec_from_yaml, parse_cluster_spec
from trainlift.errors import SpecError
from trainlift.render import JobInputs, render_cluster
from trainlift.render.validate import crd_problems

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "examples" / "cluster-reference.yaml"
P5 = ROOT / "examples" / "cluster-p5.yaml"
JOB = JobInputs(name="sft", spec_path="jobs/sft.yaml", workers=8, working_dir="s3://my-trainlift-checkpoints/code/j.zip",
                trainlift_uri="s3://my-trainlift-checkpoints/code/trainlift.zip")
KUEUE_KINDS = {"Topology", "ResourceFlavor", "ClusterQueue", "LocalQueue"}
EKS_LAYERS = ["topology.k8s.aws/network-node-layer-1", "topology.k8s.aws/network-node-layer-2",
              "topology.k8s.aws/network-node-layer-3"]


def spec_data(path: Path, **changes) -> dict:
    data = yaml.safe_load(path.read_text())
    data.update(changes)
    return data


def p4d_data() -> dict:
    data = spec_data(P5, name="ray-train-p4d")
    data["workers"][0].update(name="a100", instance_type="p4d.24xlarge", count=4)
    return data


SPECS = {
    "reference": lambda: spec_data(REFERENCE),
    "p5": lambda: spec_data(P5),
    "p4d": p4d_data,
}


def manifests(data: dict, job: JobInputs | None = JOB) -> dict:
    return {m.path: m.body for m in render_cluster(parse_cluster_spec(data), job)}


def kueue_objects(rendered: dict) -> list[dict]:
    return [b for b in rendered.values() if isinstance(b, dict) and b.get("kind") in KUEUE_KINDS]


@pytest.mark.parametrize("name", SPECS)
def test_every_kueue_object_validates_strictly_at_the_storage_version(name):
    objects = kueue_objects(manifests(SPECS[name]()))
    assert {o["kind"] for o in objects} >= {"ResourceFlavor", "ClusterQueue", "LocalQueue"}
    for obj in objects:
        assert obj["apiVersion"] == "kueue.x-k8s.io/v1beta2"
        assert crd_problems(obj) == [], obj["kind"]


def test_an_unknown_field_in_a_queue_object_is_caught():
    [queue] = [o for o in kueue_objects(manifests(SPECS["p5"]())) if o["kind"] == "ClusterQueue"]
    queue["spec"]["quota"] = 1
    assert any("spec.quota: unknown field" in p for p in crd_problems(queue))


def by_flavor(queue: dict) -> dict[str, dict[str, str]]:
    [group] = queue["spec"]["resourceGroups"]
    return {f["name"]: {r["name"]: r["nominalQuota"] for r in f["resources"]} for f in group["flavors"]}


# Each worker pod's ephemeral storage by hand: the type's NVMe in GiB (GB·10⁹ / 2³⁰), less kubelet's 10% nodefs
# eviction headroom, rounded down, less the 60 GiB image reserve; times the node count.
#   reference, 2 × g6.12xlarge, 3,760 GB:  3,501.77 GiB · 0.9 = 3,151.6  -> 3,151 - 60 = 3,091 GiB · 2 = 6,182
#   p5, 2 × p5.48xlarge, 30,400 GB:       28,312.21 GiB · 0.9 = 25,481.0 -> 25,480 - 60 = 25,420 GiB · 2 = 50,840
#   p4d, 4 × p4d.24xlarge, 8,000 GB:       7,450.58 GiB · 0.9 = 6,705.5  -> 6,705 - 60 = 6,645 GiB · 4 = 26,580
EPHEMERAL_BY_HAND = {"reference": "6182Gi", "p5": "50840Gi", "p4d": "26580Gi"}


@pytest.mark.parametrize("name", SPECS)
def test_the_queue_quotas_are_the_node_groups_totals(name):
    data = SPECS[name]()
    rendered = manifests(data)
    [queue] = [o for o in kueue_objects(rendered) if o["kind"] == "ClusterQueue"]
    quotas = by_flavor(queue)
    worker = data["workers"][0]
    p, n = catalog.lookup(worker["instance_type"]), worker["count"]
    system = catalog.lookup(data["system"]["instance_type"])
    assert quotas[f"{data['name']}-{worker['name']}"] == {
        "cpu": str(n * p.vcpus), "memory": f"{n * p.memory_mib}Mi", "nvidia.com/gpu": str(n * p.gpus),
        "vpc.amazonaws.com/efa": str(n * p.efa_interfaces), "hugepages-2Mi": f"{n * 5120}Mi",
        "ephemeral-storage": EPHEMERAL_BY_HAND[name]}
    assert quotas[f"{data['name']}-system"] == {
        "cpu": str(system.vcpus), "memory": f"{system.memory_mib}Mi", "nvidia.com/gpu": "0",
        "vpc.amazonaws.com/efa": "0", "hugepages-2Mi": "0", "ephemeral-storage": "0"}


def test_p5_numbers_by_hand():
    [queue] = [o for o in kueue_objects(manifests(SPECS["p5"]())) if o["kind"] == "ClusterQueue"]
    # 2 x p5.48xlarge: 192 vCPUs, 2 TiB, 8 H100, 32 EFA interfaces each.
    assert by_flavor(queue)["ray-train-p5-h100"]["nvidia.com/gpu"] == "16"
    assert by_flavor(queue)["ray-train-p5-h100"]["cpu"] == "384"
    # 30,400 GB of NVMe = 28,312.2 GiB; 90% is 25,480, less the 60 GiB image reserve: 25,420 GiB per pod, 2 pods.
    assert by_flavor(queue)["ray-train-p5-h100"]["ephemeral-storage"] == "50840Gi"
    assert by_flavor(queue)["ray-train-p5-h100"]["memory"] == f"{2 * 2048 * 1024}Mi"
    assert queue["spec"]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "ray-train"}}


@pytest.mark.parametrize("name", ["p5", "p4d"])
def test_topology_levels_are_the_eks_network_labels_then_the_node(name):
    rendered = manifests(SPECS[name]())
    [topology] = [o for o in kueue_objects(rendered) if o["kind"] == "Topology"]
    assert [lvl["nodeLabel"] for lvl in topology["spec"]["levels"]] == EKS_LAYERS + ["kubernetes.io/hostname"]
    flavor = next(o for o in kueue_objects(rendered) if o["kind"] == "ResourceFlavor" and "topologyName" in o["spec"])
    assert flavor["spec"]["topologyName"] == topology["metadata"]["name"]
    worker = rendered["k8s/20-raycluster.yaml"]["spec"]["workerGroupSpecs"][0]
    assert worker["template"]["metadata"]["annotations"] == {
        "kueue.x-k8s.io/podset-preferred-topology": "topology.k8s.aws/network-node-layer-3"}


def test_a_four_layer_type_gets_the_fourth_layer_and_required_placement():
    data = spec_data(P5, placement="required")
    data["workers"][0]["instance_type"] = "p6-b200.48xlarge"
    rendered = manifests(data)
    [topology] = [o for o in kueue_objects(rendered) if o["kind"] == "Topology"]
    levels = [lvl["nodeLabel"] for lvl in topology["spec"]["levels"]]
    assert levels == EKS_LAYERS + ["topology.k8s.aws/network-node-layer-4", "kubernetes.io/hostname"]
    worker = rendered["k8s/20-raycluster.yaml"]["spec"]["workerGroupSpecs"][0]
    assert worker["template"]["metadata"]["annotations"] == {
        "kueue.x-k8s.io/podset-required-topology": "topology.k8s.aws/network-node-layer-4"}


def test_which_types_have_four_layers_is_catalog_data_with_a_source():
    four = [t for t in catalog.instance_types(gpu=True) if catalog.lookup(t).network_layers == 4]
    assert four == ["p6-b200.48xlarge"]
    assert "Prerequisites for Amazon EC2 topology" in catalog.lookup("p5.48xlarge").sources["network_layers"]


def test_g6_has_no_topology_labels_so_no_topology_is_rendered():
    rendered = manifests(SPECS["reference"]())
    assert not [o for o in kueue_objects(rendered) if o["kind"] == "Topology"]
    worker = rendered["k8s/20-raycluster.yaml"]["spec"]["workerGroupSpecs"][0]
    assert "annotations" not in worker["template"]["metadata"]


@pytest.mark.parametrize("name", SPECS)
def test_the_standing_cluster_is_queued_and_the_rayjob_runs_on_it_outside_the_queue(name):
    """Kueue's webhook (v0.19.2) accepts a RayJob with clusterSelector and no rayClusterSpec and does not manage it,
    so the job takes no quota beside the RayCluster that holds it: the README's path cannot deadlock."""
    rendered = manifests(SPECS[name]())
    cluster, job = rendered["k8s/20-raycluster.yaml"], rendered["k8s/30-rayjob.yaml"]
    [local] = [o for o in kueue_objects(rendered) if o["kind"] == "LocalQueue"]
    assert cluster["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == local["metadata"]["name"]
    assert local["metadata"]["namespace"] == cluster["metadata"]["namespace"]
    assert "kueue.x-k8s.io/queue-name" not in job["metadata"]["labels"]
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    assert "rayClusterSpec" not in job["spec"] and job["spec"]["shutdownAfterJobFinishes"] is False
    assert cluster["spec"]["enableInTreeAutoscaling"] is False  # Kueue rejects autoscaling on a non-elastic cluster


def test_max_hours_becomes_the_active_deadline():
    from dataclasses import replace

    job = manifests(SPECS["p5"](), replace(JOB, max_hours=1.5))["k8s/30-rayjob.yaml"]
    assert job["spec"]["activeDeadlineSeconds"] == 5400
    assert crd_problems(job) == []


def test_max_hours_must_be_positive_in_the_job_spec():
    from pydantic import ValidationError

    from trainlift.config.job import RunSection

    with pytest.raises(ValidationError):
        RunSection(max_hours=0)
    assert RunSection(max_hours=0.5).max_hours == 0.5


def test_kueue_is_installed_pinned_from_its_oci_chart():
    rendered = {m.path: m for m in render_cluster(parse_cluster_spec(SPECS["p5"]()))}
    releases = rendered["helm/releases.yaml"].body["releases"]
    assert [r["name"] for r in releases][-1] == "kueue"
    assert rendered["helm/kueue.values.yaml"].comment.splitlines() == [
        "helm pull oci://registry.k8s.io/kueue/charts/kueue --version 0.19.2 --destination charts",
        "helm upgrade --install kueue charts/kueue-0.19.2.tgz --namespace kueue-system --values "
        "helm/kueue.values.yaml --create-namespace"]


def test_gpu_clusters_default_to_kueue():
    assert cluster_spec_from_yaml(REFERENCE.read_text()).scheduler == "kueue"


@pytest.mark.parametrize("changes, line", [
    ({"scheduler": "none", "placement": "required"}, "placement: required needs scheduler: kueue"),
    ({"workers": [{"name": "head", "instance_type": "g6.12xlarge", "count": 2,
                   "availability_zones": ["us-east-2a"]}]}, "workers[0].name: 'head' is the Ray head's PodSet"),
])
def test_a_combination_the_scheduler_rejects_is_refused_in_one_line(changes, line):
    with pytest.raises(SpecError) as caught:
        render_cluster(parse_cluster_spec(spec_data(REFERENCE, **changes)))
    assert line in caught.value.message and "\n" not in caught.value.message


def test_kueue_gives_back_the_quota_of_a_workload_whose_pods_do_not_start_within_the_pull_and_start_time():
    """The chart takes its whole Configuration as one string; catalog/kueue_config.yaml is the chart's own (equal,
    as parsed, to charts/kueue/values.yaml@v0.19.2 when checked), and only waitForPodsReady is added."""
    from trainlift.catalog.lookup import load_data

    rendered = {m.path: m for m in render_cluster(parse_cluster_spec(SPECS["reference"]()))}
    text = rendered["helm/kueue.values.yaml"].body["managerConfig"]["controllerManagerConfigYaml"]
    config = yaml.safe_load(text)
    ready = config.pop("waitForPodsReady")
    assert config == load_data("kueue_config.yaml")
    assert "ray.io/raycluster" in config["integrations"]["frameworks"]
    # Twice the DLC's modelled first pull (24 GB: 6m03s on m7i.xlarge and g6.12xlarge) + 4 minutes of Ray's start,
    # against Kueue's default 30 (render/cold_start.py); a replaced node keeps the default.
    assert ready["timeout"] == "17m" and ready["recoveryTimeout"] == "30m"
    assert ready["requeuingStrategy"]["timestamp"] == "Eviction"
