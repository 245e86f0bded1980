"""Parallel image pull on EKS nodes: every node group's NodeConfig turns on nodeadm's FastImagePull feature gate (the
SOCI snapshotter's parallel pull-and-unpack mode on the AL2023 AMI), nodes that write layers to their root volume get
the throughput nodeadm asks for, and the NodeConfig is checked against nodeadm's own CRD (v20260724). No EKS node runs
here: the rules are nodeadm's (internal/containerd/config.go, doc/examples.md) and eksctl's schema."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trainlift import catalog
from trainlift.config.cluster import parse_cluster_spec
from trainlift.errors import SpecError
from trainlift.render import render_cluster
from trainlift.render.eksctl import pulls_in_parallel
from trainlift.render.validate import eksctl_problems, node_config_problems

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ("cluster-reference.yaml", "cluster-p5.yaml")


def example(name: str, **image) -> dict:
    data = yaml.safe_load((ROOT / "examples" / name).read_text())
    data.setdefault("image", {}).update(image)
    return data


def node_groups(data: dict) -> dict[str, dict]:
    [config] = [m.body for m in render_cluster(parse_cluster_spec(data)) if m.path == "eksctl.yaml"]
    assert eksctl_problems(config) == []
    return {g["name"]: g for g in config["managedNodeGroups"]}


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_group_pulls_in_parallel_with_its_layers_on_fast_storage(name):
    groups = node_groups(example(name))
    assert len(groups) >= 2  # the system group (the Ray head pulls the same image) and the GPU workers
    for group in groups.values():
        spec = yaml.safe_load(group["overrideBootstrapCommand"])["spec"]
        assert spec["featureGates"] == {"FastImagePull": True}
        if catalog.lookup(group["instanceType"]).local_nvme_gb:
            # nodeadm binds SOCI's directory onto the instance-store RAID0: the root volume stays as it was
            assert spec["instance"]["localStorage"]["strategy"] == "RAID0"
            assert "volumeThroughput" not in group
        else:
            assert (group["volumeType"], group["volumeThroughput"]) == ("gp3", 600)


@pytest.mark.parametrize("name", EXAMPLES)
def test_parallel_pull_off_leaves_containerd_and_the_volumes_as_they_were(name):
    groups = node_groups(example(name, parallel_pull=False))
    for group in groups.values():
        assert "volumeThroughput" not in group and "volumeType" not in group
        if catalog.lookup(group["instanceType"]).local_nvme_gb:
            spec = yaml.safe_load(group["overrideBootstrapCommand"])["spec"]
            assert "featureGates" not in spec and spec["instance"]["localStorage"] == {"strategy": "RAID0"}
        else:
            assert "overrideBootstrapCommand" not in group


def test_nodes_below_nodeadms_threshold_are_not_asked_to():
    spec = parse_cluster_spec(example("cluster-reference.yaml"))
    profile = catalog.lookup("m7i.xlarge")  # 4 vCPUs, 16 GiB: at nodeadm's floor
    assert pulls_in_parallel(spec, profile)
    assert not pulls_in_parallel(spec, profile.model_copy(update={"vcpus": 2}))
    assert not pulls_in_parallel(spec, profile.model_copy(update={"memory_mib": 6 * 1024}))


def test_a_node_config_nodeadm_would_refuse_is_a_render_problem():
    good = "apiVersion: node.eks.aws/v1alpha1\nkind: NodeConfig\nspec:\n  featureGates:\n    FastImagePull: true\n"
    assert node_config_problems(good) == []
    problems = node_config_problems(good.replace("FastImagePull", "FastImagePulls")
                                    + "  instance:\n    localStorage:\n      strategy: RAID5\n")
    assert any("FastImagePulls: not one of nodeadm's" in p for p in problems)
    assert any("strategy: 'RAID5' is not one of ['RAID0', 'RAID10', 'Mount']" in p for p in problems)
    assert node_config_problems("#!/bin/bash\necho hi\n") == ["not a nodeadm NodeConfig (kind: NodeConfig)"]


def test_another_ami_family_is_refused_by_name():
    data = example("cluster-reference.yaml")
    data["ami_family"] = "Bottlerocket"
    with pytest.raises(SpecError) as raised:
        parse_cluster_spec(data)
    assert "ami_family" in str(raised.value) and "AmazonLinux2023" in str(raised.value)


def test_render_says_how_each_group_pulls(tmp_path):
    from typer.testing import CliRunner

    from trainlift.cli import app

    runner = CliRunner()
    shown = runner.invoke(app, ["render", str(ROOT / "examples" / "cluster-p5.yaml"), "--check"])
    assert shown.exit_code == 0, shown.output
    assert ("pull   h100 (p5.48xlarge): parallel (SOCI pull-and-unpack, nodeadm FastImagePull), layers on the "
            "instance-store RAID0") in shown.output
    spec = tmp_path / "sequential.yaml"
    spec.write_text(yaml.safe_dump(example("cluster-p5.yaml", parallel_pull=False)))
    as_json = runner.invoke(app, ["render", str(spec), "--check", "--json"])
    assert as_json.exit_code == 0, as_json.output
    pulls = __import__("json").loads(as_json.stdout)["image_pull"]
    assert pulls["h100"] == "h100 (p5.48xlarge): sequential (image.parallel_pull: false)"
