"""The staging volume: worker nodes RAID0 their instance-store NVMe under kubelet (eksctl's AL2023 NodeConfig), the
worker pods mount a sized emptyDir there at the path the recipe stages checkpoints in, and request the ephemeral
storage it takes; every object still validates against the eksctl and KubeRay schemas."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trainlift import catalog
from trainlift.config.cluster import parse_cluster_spec
from trainlift.render import JobInputs, render_cluster
from trainlift.render.raycluster import STAGING_PATH, ephemeral_gib, staging_gib
from trainlift.render.validate import crd_problems, eksctl_problems
from trainlift.train.model.fetch import STAGING_ENV

ROOT = Path(__file__).resolve().parents[2]
JOB = JobInputs(name="sft", spec_path="jobs/sft.yaml", workers=8, working_dir="s3://my-trainlift-checkpoints/code/j.zip",
                trainlift_uri="s3://my-trainlift-checkpoints/code/trainlift.zip")
CLUSTERS = {"reference": "cluster-reference.yaml", "p5": "cluster-p5.yaml"}


def rendered(name: str) -> dict:
    data = yaml.safe_load((ROOT / "examples" / CLUSTERS[name]).read_text())
    return {m.path: m.body for m in render_cluster(parse_cluster_spec(data), JOB)}, data


def worker_pods(objects: dict) -> list[dict]:
    pods = []
    for body in objects.values():
        if isinstance(body, dict) and body.get("kind") in ("RayCluster", "RayJob"):
            cluster = body["spec"] if body["kind"] == "RayCluster" else body["spec"].get("rayClusterSpec")
            if cluster is None:
                continue
            pods += [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]
    return pods


@pytest.mark.parametrize("name", CLUSTERS)
def test_worker_pods_mount_the_staging_volume_where_the_recipe_stages(name):
    objects, data = rendered(name)
    profile = catalog.lookup(data["workers"][0]["instance_type"])
    pods = worker_pods(objects)
    assert pods
    for pod in pods:
        [container] = pod["containers"]
        [volume] = [v for v in pod["volumes"] if v["name"] == "staging"]
        assert volume == {"name": "staging", "emptyDir": {"sizeLimit": f"{staging_gib(profile)}Gi"}}
        assert {"name": "staging", "mountPath": STAGING_PATH} in container["volumeMounts"]
        assert {"name": STAGING_ENV, "value": STAGING_PATH} in container["env"]
        for side in ("requests", "limits"):
            assert container["resources"][side]["ephemeral-storage"] == f"{ephemeral_gib(profile)}Gi"
    for body in objects.values():
        if isinstance(body, dict) and body.get("kind") in ("RayCluster", "RayJob"):
            assert crd_problems(body) == []


@pytest.mark.parametrize("name", CLUSTERS)
def test_gpu_nodes_raid_their_nvme_under_kubelet(name):
    objects, _ = rendered(name)
    [config] = [b for p, b in objects.items() if p.endswith("eksctl.yaml")]
    assert eksctl_problems(config) == []
    groups = {g["name"]: g for g in config["managedNodeGroups"]}
    for group in groups.values():
        nvme = catalog.lookup(group["instanceType"]).local_nvme_gb
        node_config = yaml.safe_load(group["overrideBootstrapCommand"])
        assert (node_config["apiVersion"], node_config["kind"]) == ("node.eks.aws/v1alpha1", "NodeConfig")
        if not nvme:
            assert "instance" not in node_config["spec"]  # the system nodes have no instance store
            continue
        assert node_config["spec"]["instance"] == {"localStorage": {"strategy": "RAID0"}}


def test_staging_sizes_by_hand():
    # g6.12xlarge: 3,760 GB of NVMe = 3,501.8 GiB; 90% of it is 3,151, less the 60 GiB image reserve: 3,091 GiB
    # for the pod, of which the staging volume takes all but 20 GiB of scratch.
    assert ephemeral_gib(catalog.lookup("g6.12xlarge")) == 3091
    assert staging_gib(catalog.lookup("g6.12xlarge")) == 3071
    assert staging_gib(catalog.lookup("m7i.xlarge")) == 0  # no instance store: no staging volume
