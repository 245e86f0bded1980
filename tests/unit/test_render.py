"""Rendering: every GPU type x fabric validates; resources, fabric env, storage, taints, RayJob."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from trainlift import catalog
from trainlift.config.cluster import parse_cluster_spec
from trainlift.errors import SpecError
from trainlift.render import JobInputs, render_cluster, render_manifests, validate_manifests
from trainlift.render import job_launch
from trainlift.render.rayjob import k8s_name, render_rayjob
from trainlift.render.validate import crd_problems, unknown_fields

BASE: dict[str, Any] = {
    "name": "train",
    "availability_zones": ["us-east-2a", "us-east-2b"],
    "workers": [{"instance_type": "g6.12xlarge", "count": 2, "availability_zones": ["us-east-2a"]}],
}


def make(**changes: Any):
    data = copy.deepcopy(BASE)
    worker = changes.pop("worker", None)
    if worker:
        data["workers"][0].update(worker)
    data.update(changes)
    return parse_cluster_spec(data)


def by_path(manifests) -> dict[str, Any]:
    return {m.path: m.body for m in manifests}


def worker_container(manifests, group: int = 0) -> dict[str, Any]:
    cluster = by_path(manifests)["k8s/20-raycluster.yaml"]
    return cluster["spec"]["workerGroupSpecs"][group]["template"]["spec"]["containers"][0]


def env_of(container) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@pytest.mark.parametrize("fabric", ["efa", "socket"])
@pytest.mark.parametrize("instance_type", catalog.instance_types(gpu=True))
def test_every_gpu_type_and_fabric_renders_and_validates(instance_type, fabric):
    profile = catalog.lookup(instance_type)
    spec = make(fabric=fabric, worker={"instance_type": instance_type})
    if fabric == "efa" and not profile.efa_supported:
        with pytest.raises(SpecError, match=r"workers\[0\]\.instance_type: fabric is efa"):
            render_cluster(spec)
        return
    manifests = render_cluster(spec)
    limits = worker_container(manifests)["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == str(profile.gpus)
    assert limits.get("vpc.amazonaws.com/efa") == (str(profile.efa_interfaces) if fabric == "efa" else None)
    group = by_path(manifests)["eksctl.yaml"]["managedNodeGroups"][1]
    assert group["efaEnabled"] is (fabric == "efa")
    assert int(limits["cpu"]) < profile.vcpus and int(limits["memory"].removesuffix("Gi")) < profile.memory_gib


def test_p5_requests_32_efa_interfaces_and_8_gpus():
    limits = worker_container(render_cluster(make(worker={"instance_type": "p5.48xlarge"})))["resources"]["limits"]
    assert (limits["vpc.amazonaws.com/efa"], limits["nvidia.com/gpu"]) == ("32", "8")


def test_g6_12xlarge_requests_1_efa_interface_and_4_gpus():
    container = worker_container(render_cluster(make()))
    for side in ("limits", "requests"):
        amounts = container["resources"][side]
        assert (amounts["vpc.amazonaws.com/efa"], amounts["nvidia.com/gpu"]) == ("1", "4")


def test_efa_env_pins_the_ofi_network_and_mounts_shm():
    container = worker_container(render_cluster(make()))
    env = env_of(container)
    # aws-ofi-nccl doc/efa-env-var.md: not needed with current plugins (the image sets it anyway).
    assert not {"FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA", "FI_EFA_FORK_SAFE", "NCCL_PROTO"} & set(env)
    assert not [name for name in env if name.startswith("RDMAV_")]
    assert env["NCCL_NET_PLUGIN"] == "ofi"
    assert env["NCCL_NET"] == "Libfabric"
    assert env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert (env["NCCL_DEBUG"], env["NCCL_DEBUG_SUBSYS"]) == ("INFO", "INIT,NET")
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
    # preStop waits while the head still runs a job (its final checkpoint), then stops Ray; the grace period covers it
    assert container["lifecycle"]["preStop"]["exec"]["command"][-1].endswith("'; ray stop")
    pod = by_path(render_cluster(make()))["k8s/20-raycluster.yaml"]["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= int(env["RAY_JOB_STOP_WAIT_TIME_S"]) + 30


def test_socket_fabric_forces_tcp_and_skips_efa():
    spec = make(fabric="socket", worker={"availability_zones": []}, availability_zones=[])
    manifests = by_path(render_cluster(spec))
    env = env_of(manifests["k8s/20-raycluster.yaml"]["spec"]["workerGroupSpecs"][0]["template"]["spec"]
                 ["containers"][0])
    assert env["NCCL_NET"] == "Socket" and "FI_PROVIDER" not in env
    assert "helm/aws-efa-k8s-device-plugin.values.yaml" not in manifests
    assert "availabilityZones" not in manifests["eksctl.yaml"]


def test_fabric_defaults_from_the_catalog():
    assert make().fabric == "efa"
    no_efa = make(worker={"instance_type": "g6.4xlarge", "availability_zones": []}, availability_zones=[])
    assert no_efa.fabric == "socket"


def test_head_has_no_gpus_and_a_cluster_ip_dashboard():
    cluster = by_path(render_cluster(make()))["k8s/20-raycluster.yaml"]
    head = cluster["spec"]["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP"
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert head["template"]["spec"]["nodeSelector"] == {"role": "system"}
    resources = head["template"]["spec"]["containers"][0]["resources"]["limits"]
    from trainlift.render.fit import cpu_m

    assert "nvidia.com/gpu" not in resources and cpu_m(resources["cpu"]) < 4000
    assert cluster["spec"]["rayVersion"] == "2.58.0"


def test_taints_become_tolerations_everywhere():
    taint = {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}
    manifests = by_path(render_cluster(make(worker={"taints": [taint, {"key": "dedicated"}]})))
    pod = manifests["k8s/20-raycluster.yaml"]["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Equal", "value": "true", "effect": "NoSchedule"},
        {"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"},
    ]
    assert manifests["eksctl.yaml"]["managedNodeGroups"][1]["taints"][0] == taint
    efa_tolerations = manifests["helm/aws-efa-k8s-device-plugin.values.yaml"]["tolerations"]
    assert {"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"} in efa_tolerations
    nvidia = manifests["helm/nvidia-device-plugin.values.yaml"]["tolerations"]
    assert {"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"} in nvidia


def test_placement_group_and_capacity_reservation():
    spec = make(worker={"placement_group": "train-pg", "capacity_reservation_id": "cr-0123456789abcdef0"})
    group = by_path(render_cluster(spec))["eksctl.yaml"]["managedNodeGroups"][1]
    assert group["placement"] == {"groupName": "train-pg"}
    assert group["capacityReservation"]["capacityReservationTarget"]["capacityReservationID"] == (
        "cr-0123456789abcdef0"
    )


def test_s3_storage_gets_a_scoped_irsa_role():
    manifests = by_path(render_cluster(make(storage={"s3": {"uri": "s3://bucket-a/runs/x"}})))
    (account,) = manifests["eksctl.yaml"]["iam"]["serviceAccounts"]
    assert account["metadata"] == {"name": "ray-train", "namespace": "ray-train"}
    resources = [s["Resource"] for s in account["attachPolicy"]["Statement"]]
    assert "arn:aws:s3:::bucket-a/runs/x/*" in resources
    pod = manifests["k8s/20-raycluster.yaml"]["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert pod["serviceAccountName"] == "ray-train"
    assert "k8s/10-serviceaccount.yaml" not in manifests


def test_s3_storage_with_an_existing_role_renders_the_service_account():
    role = "arn:aws:iam::123456789012:role/checkpoints"
    manifests = by_path(render_cluster(make(storage={"s3": {"uri": "s3://bucket-a", "role_arn": role}})))
    account = manifests["k8s/10-serviceaccount.yaml"]
    assert account["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": role}
    assert "serviceAccounts" not in manifests["eksctl.yaml"]["iam"]


def test_fsx_storage_mounts_the_claim_and_adds_the_csi_driver():
    manifests = by_path(render_cluster(make(storage={"fsx": {"claim": "fsx-claim"}})))
    pod = manifests["k8s/20-raycluster.yaml"]["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "fsx-claim"}} in pod["volumes"]
    assert {"name": "checkpoints", "mountPath": "/fsx"} in pod["containers"][0]["volumeMounts"]
    addons = [a["name"] for a in manifests["eksctl.yaml"]["addons"]]
    assert "aws-fsx-csi-driver" in addons and "eks-pod-identity-agent" in addons


def test_secrets_are_references():
    spec = make(secrets=[{"env": "HF_TOKEN", "secret": "hf-token", "key": "token"}], env={"WANDB_MODE": "offline"})
    env = env_of(worker_container(render_cluster(spec)))
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    assert env["WANDB_MODE"] == "offline"


def test_output_is_deterministic():
    first = [m.text() for m in render_cluster(make())]
    second = [m.text() for m in render_cluster(make())]
    assert first == second


def test_two_worker_groups_each_pinned_to_their_nodes():
    spec = make(workers=[
        {"name": "a", "instance_type": "p5.48xlarge", "count": 2, "availability_zones": ["us-east-2a"]},
        {"name": "b", "instance_type": "p5en.48xlarge", "count": 1, "availability_zones": ["us-east-2a"]},
    ])
    manifests = by_path(render_cluster(spec))
    groups = manifests["k8s/20-raycluster.yaml"]["spec"]["workerGroupSpecs"]
    assert [g["template"]["spec"]["nodeSelector"]["trainlift.io/worker-group"] for g in groups] == ["a", "b"]
    assert manifests["helm/aws-efa-k8s-device-plugin.values.yaml"]["supportedInstanceLabels"]["values"] == [
        "p5.48xlarge", "p5en.48xlarge"]
    assert spec.gpu_count == 24


def test_schema_validation_flags_unknown_and_mistyped_fields():
    manifests = render_manifests(make())
    cluster = next(m for m in manifests if m.path == "k8s/20-raycluster.yaml")
    cluster.body["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["shmSize"] = "1Gi"
    cluster.body["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    with pytest.raises(SpecError) as info:
        validate_manifests(manifests, "1.36")
    message = info.value.message
    assert "k8s/20-raycluster.yaml: spec.workerGroupSpecs[0].template.spec.containers[0].shmSize: unknown field" in message
    assert "spec.headGroupSpec.rayStartParams.num-cpus: 0 is not of type 'string'" in message


def test_eksctl_and_core_objects_are_validated():
    manifests = render_manifests(make())
    next(m for m in manifests if m.path == "eksctl.yaml").body["managedNodeGroups"][1]["efa"] = True
    next(m for m in manifests if m.path == "k8s/00-namespace.yaml").body["metadata"]["name"] = 7
    with pytest.raises(SpecError) as info:
        validate_manifests(manifests, "1.36")
    assert "eksctl.yaml: managedNodeGroups[1]: Additional properties are not allowed ('efa'" in info.value.message
    assert "k8s/00-namespace.yaml: metadata.name" in info.value.message


def test_unknown_field_walk_honours_preserve_unknown_fields():
    schema = {"type": "object", "properties": {
        "open": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        "closed": {"type": "object", "properties": {"a": {"type": "string"}}},
        "map": {"type": "object", "additionalProperties": {"type": "string"}},
    }}
    node = {"open": {"anything": 1}, "closed": {"a": "x", "b": "y"}, "map": {"k": "v"}, "extra": 1}
    assert unknown_fields(node, schema) == [
        "closed.b: unknown field (the API server would drop it)",
        "extra: unknown field (the API server would drop it)",
    ]


def job(**changes: Any) -> JobInputs:
    values: dict[str, Any] = {"name": "Qwen SFT_1", "spec_path": "jobs/sft.yaml", "workers": 8,
                              "working_dir": "s3://bucket/code.zip", "trainlift_uri": "s3://bucket/trainlift.zip"}
    values.update(changes)
    return JobInputs(**values)


def test_rayjob_on_the_rendered_cluster():
    body = render_rayjob(make(scheduler="none"), job(overrides=("run.storage=s3://b/x",)))
    assert crd_problems(body) == []
    assert body["metadata"]["name"] == "qwen-sft-1"
    assert body["spec"]["entrypoint"] == "python -m trainlift train jobs/sft.yaml --set run.storage=s3://b/x"
    assert body["spec"]["clusterSelector"] == {"ray.io/cluster": "train"}
    assert body["spec"]["shutdownAfterJobFinishes"] is False
    assert yaml.safe_load(body["spec"]["runtimeEnvYAML"]) == {
        "working_dir": "s3://bucket/code.zip", "py_modules": ["s3://bucket/trainlift.zip"],
        "env_vars": {"PYTHONUNBUFFERED": "1", **job_launch.QUIET_JOB_ENV}}
    assert body["spec"]["submitterConfig"] == {"backoffLimit": 2}


def test_rayjob_with_its_own_cluster_shuts_it_down():
    body = render_rayjob(make(), job(shutdown_after_finish=True, ttl_seconds_after_finished=60))
    assert crd_problems(body) == []
    assert body["spec"]["shutdownAfterJobFinishes"] is True
    assert body["spec"]["ttlSecondsAfterFinished"] == 60
    assert body["spec"]["rayClusterSpec"]["rayVersion"] == "2.58.0"
    assert "clusterSelector" not in body["spec"]


def test_rayjob_rules():
    with pytest.raises(SpecError, match=r"scaling\.workers: 16 workers need 16 GPUs; the cluster has 8"):
        render_rayjob(make(), job(workers=16))
    with pytest.raises(SpecError, match=r"runtime_env\.working_dir: \./ is a local path"):
        render_rayjob(make(), job(working_dir="./"))
    with pytest.raises(SpecError, match=r"runtime_env\.py_modules: no trainlift package is given; the cluster"):
        render_rayjob(make(), job(trainlift_uri=None))


def test_rayjob_starts_the_job_as_submit_does(tmp_path):
    """The DLC image has no `trainlift` command: the RayJob must run the module that py_modules ships, with the
    entrypoint and runtime_env `trainlift submit` sends through the Jobs API (only the URIs differ, and submit
    alone asks for machine-readable progress lines, which its --follow reads)."""
    from trainlift.ops import jobs

    overrides = ("run.storage=s3://b/x",)
    body = render_rayjob(make(), job(overrides=overrides))
    submitted = jobs.runtime_env(tmp_path, [], [], {})
    rendered = yaml.safe_load(body["spec"]["runtimeEnvYAML"])
    assert body["spec"]["entrypoint"] == jobs.entrypoint("jobs/sft.yaml", list(overrides))
    assert set(rendered) == set(submitted) - {"excludes"}
    assert rendered["env_vars"] == {k: v for k, v in submitted["env_vars"].items() if k != jobs.PROGRESS_ENV}
    assert submitted["env_vars"][jobs.PROGRESS_ENV] == "json"
    assert len(rendered["py_modules"]) == len(submitted["py_modules"]) == 1


def test_render_cluster_with_a_job_adds_the_rayjob():
    storage = {"s3": {"uri": "s3://bucket/runs", "read": ["s3://bucket/code.zip", "s3://bucket/trainlift.zip"]}}
    manifests = by_path(render_cluster(make(storage=storage), job()))
    assert manifests["k8s/30-rayjob.yaml"]["kind"] == "RayJob"


@pytest.mark.parametrize("name, expected", [("run", "run"), ("7b", "job-7b"), ("A" * 80, "a" * 47)])
def test_k8s_name(name, expected):
    assert k8s_name(name) == expected


def test_every_rendered_eksctl_config_carries_the_owner_tag():
    """A cluster created with `eksctl create cluster -f` from `render -o` is one `cluster down` recognizes: the tag
    `cluster up` checks (ops.preflight) is in the render itself, not added by `cluster up` alone."""
    from pathlib import Path

    from trainlift.ops.preflight import OWNER_TAG

    for name in ("cluster-reference.yaml", "cluster-p5.yaml"):
        spec = parse_cluster_spec(yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / name).read_text()))
        config = next(m for m in render_cluster(spec) if m.kind == "ClusterConfig")
        assert yaml.safe_load(config.text())["metadata"]["tags"] == {OWNER_TAG: spec.name}, name
