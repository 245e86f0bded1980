"""Kueue admission on paper (render/admission.py): the rendered workloads Kueue queues, admitted in apply order
against the ClusterQueue's quotas. Kueue's rules are from its v0.19.2 source (pkg/controller/jobs/raycluster and
rayjob: a PodSet per Ray group, the submitter's in K8sJobMode, a RayCluster holding quota while it exists); no API
server runs here, so the check is run on the rendered objects, and the README's reference path is rendered as
written."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from trainlift.cli import app
from trainlift.config.cluster import parse_cluster_spec
from trainlift.errors import SpecError
from trainlift.render import JobInputs, admission, admissions, render_cluster, render_manifests

ROOT = Path(__file__).resolve().parents[2]
CLUSTERS = {"reference": ROOT / "examples" / "cluster-reference.yaml", "p5": ROOT / "examples" / "cluster-p5.yaml"}
JOB = JobInputs(name="sft", spec_path="jobs/sft.yaml", working_dir="s3://my-trainlift-checkpoints/code/j.zip",
                trainlift_uri="s3://my-trainlift-checkpoints/code/trainlift.whl")


def spec(name: str):
    return parse_cluster_spec(yaml.safe_load(CLUSTERS[name].read_text()))


def bodies(manifests) -> list[tuple[str, dict]]:
    return [(m.path, m.body) for m in manifests]


@pytest.mark.parametrize("name", CLUSTERS)
def test_the_examples_admit_the_standing_cluster_and_run_the_job_outside_the_queue(name):
    manifests = render_cluster(spec(name), JOB)
    lines = admissions(manifests)
    gpus = spec(name).gpu_count
    assert lines[0].startswith(f"RayCluster {spec(name).name} admitted in ClusterQueue {spec(name).name}: ")
    assert f"nvidia.com/gpu {gpus} of {gpus}" in lines[0]
    assert lines[1] == (f"RayJob sft runs on RayCluster {spec(name).name} (clusterSelector): Kueue does not queue it, "
                        "and it takes no quota")


def test_a_job_with_its_own_cluster_beside_the_standing_one_is_refused_naming_the_gpus():
    with pytest.raises(SpecError) as caught:
        render_cluster(spec("reference"), replace(JOB, shutdown_after_finish=True))
    message = caught.value.message
    assert message == ("k8s/30-rayjob.yaml: Kueue would never admit RayJob sft: it needs nvidia.com/gpu 8 in flavor "
                       "ray-train-gpu-workers, whose quota in ClusterQueue ray-train is 8, and RayCluster ray-train "
                       "holds 8 of it while it exists")
    assert "without --job-shutdown the RayJob uses clusterSelector" in caught.value.hint


def test_a_job_with_its_own_cluster_alone_is_admitted_with_its_submitter_on_the_system_flavor():
    manifests = bodies(render_manifests(spec("p5"), replace(JOB, shutdown_after_finish=True)))
    queue = admission.cluster_queue(manifests)
    [job] = [w for w in admission.queued_workloads(manifests) if w.kind == "RayJob"]
    assert [ps.name for ps in job.podsets] == ["head", "h100", "submitter"]
    assert admission.admit(queue, [job]) == []
    # head 2500m (the system node keeps room for one more DaemonSet) + submitter 200m on the system flavor; 2 p5
    # workers x 8 GPUs on h100's
    assert job.usage[("ray-train-p5-system", "cpu")] == 2700
    assert job.usage[("ray-train-p5-h100", "nvidia.com/gpu")] == 16
    assert job.usage[("ray-train-p5-h100", "vpc.amazonaws.com/efa")] == 64


def edited_queue(name: str, resource: str, quota: str | None) -> list[tuple[str, dict]]:
    found = copy.deepcopy(bodies(render_manifests(spec(name), JOB)))
    cq = next(b for _, b in found if isinstance(b, dict) and b.get("kind") == "ClusterQueue")
    group = cq["spec"]["resourceGroups"][0]
    for flavor in group["flavors"]:
        if quota is None:
            flavor["resources"] = [r for r in flavor["resources"] if r["name"] != resource]
        else:
            for r in flavor["resources"]:
                if r["name"] == resource and flavor["name"].endswith("h100"):
                    r["nominalQuota"] = quota
    if quota is None:
        group["coveredResources"].remove(resource)
    return found


def test_a_workload_beyond_the_quota_on_its_own_is_refused_with_the_numbers():
    found = edited_queue("p5", "nvidia.com/gpu", "8")
    [problem] = admission.admit(admission.cluster_queue(found), admission.queued_workloads(found))
    assert problem.line() == ("k8s/20-raycluster.yaml: Kueue would never admit RayCluster ray-train-p5: it needs "
                              "nvidia.com/gpu 16 in flavor ray-train-p5-h100, whose quota in ClusterQueue ray-train-p5 "
                              "is 8")
    assert "fewer workers" in problem.hint


def test_a_resource_the_queue_does_not_cover_is_refused():
    found = edited_queue("p5", "vpc.amazonaws.com/efa", None)
    [problem] = admission.admit(admission.cluster_queue(found), admission.queued_workloads(found))
    assert "it requests vpc.amazonaws.com/efa, which ClusterQueue ray-train-p5 does not cover" in problem.message


def test_render_prints_and_reports_the_admission(tmp_path):
    result = CliRunner().invoke(app, ["render", str(CLUSTERS["p5"]), "--check"])
    assert result.exit_code == 0, result.output
    assert "queue  RayCluster ray-train-p5 admitted in ClusterQueue ray-train-p5: ray-train-p5-system: cpu 2500m of " \
        "4000m" in result.output
    result = CliRunner().invoke(app, ["render", str(CLUSTERS["p5"]), "--check", "--json"])
    assert json.loads(result.stdout)["admission"][0].startswith("RayCluster ray-train-p5 admitted")
