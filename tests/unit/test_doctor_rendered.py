"""Doctor on the cluster `render` produces: facts shaped as its pods would report them.

No EKS cluster runs here. Each node's environment is the image's own (the Ray Train DLC sets FI_PROVIDER=efa and
NCCL_DEBUG=INFO and puts the plugin on LD_LIBRARY_PATH: FACTS.md) overlaid with the env its container gets in the
rendered RayCluster; the other facts are those of the DLC v1.1 stack on each node type (tests/unit/
test_doctor_rules.py). The head runs on a CPU system node with num-gpus 0, the workers on g6.12xlarge with EFA.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from trainlift.config.cluster import cluster_spec_from_yaml
from trainlift.doctor.probe import Facts
from trainlift.doctor.rules import has_errors, judge_nodes
from trainlift.render.raycluster import render_raycluster

SPEC = Path(__file__).resolve().parents[2] / "examples" / "cluster-reference.yaml"
GiB = 1024**3
PLUGIN = "/opt/amazon/ofi-nccl/lib64/libnccl-net-ofi.so"
IMAGE_ENV = {"FI_PROVIDER": "efa", "NCCL_DEBUG": "INFO", "LD_LIBRARY_PATH": "/opt/amazon/ofi-nccl/lib64:/opt/amazon/efa/lib"}
DLC = dict(python="3.13.1", torch="2.13.0+cu130", torch_cuda="13.0", torch_cudnn="91200", torch_nccl="2.29.7",
           ray="2.58.0", transformers="5.13.0", ofi_plugin=PLUGIN, ofi_plugin_candidates=[PLUGIN],
           ofi_plugin_on_ld_path=True, ofi_plugin_version="1.20.0", libfabric="2.3.0amzn1.0", efa_installer="1.49.0")


def container_env(group: dict) -> dict[str, str]:
    """What the probe records of a rendered container's env: the image's, then the pod's plain values."""
    env = {**IMAGE_ENV, **{e["name"]: e["value"] for e in group["template"]["spec"]["containers"][0]["env"] if "value" in e}}
    return {k: v for k, v in env.items() if k.startswith(("NCCL_", "FI_")) or k == "LD_LIBRARY_PATH"}


def rendered_nodes() -> list[tuple[str, Facts, bool]]:
    cluster = render_raycluster(cluster_spec_from_yaml(SPEC.read_text(), source=SPEC.name))["spec"]
    head_group, worker_group = cluster["headGroupSpec"], cluster["workerGroupSpecs"][0]
    assert head_group["rayStartParams"]["num-gpus"] == "0"
    head = Facts(hostname="ray-train-head", instance_type="m7i.xlarge", gpu_count=0, driver=None, uverbs=[],
                 fi_info_efa="no-efa", fi_info_detail="fi_getinfo: -61 (No data available)",
                 memlock_bytes=8 * 1024**2, shm_bytes=3 * GiB, env=container_env(head_group), **DLC)
    worker = Facts(hostname="ray-train-worker-0", instance_type="g6.12xlarge", gpu_count=4, gpu_model="NVIDIA L4",
                   driver="580.65.06", driver_cuda="13.0", uverbs=["/dev/infiniband/uverbs0"], fi_info_efa="ok",
                   fi_info_detail="provider: efa", memlock_bytes=None, shm_bytes=40 * GiB,
                   env=container_env(worker_group), **DLC)
    return [("head", head, True)] + [(f"w{i}", replace(worker, hostname=f"ray-train-worker-{i}"), False)
                                     for i in range(worker_group["replicas"])]


def test_the_rendered_cluster_passes_doctor_with_efa_expected():
    nodes = rendered_nodes()
    assert "NCCL_NET" not in nodes[0][1].env and nodes[1][1].env["NCCL_NET"] == "Libfabric"
    findings = judge_nodes(nodes, "efa")
    assert not has_errors(findings), [f for f in findings if f.severity == "error"]
    assert not [f for f in findings if f.node == "head" and f.rule in ("efa_device", "fi_info_efa", "memlock")]
    assert {f.rule for f in findings if f.node == "w1" and f.severity == "ok"} >= {"efa_device", "nccl_net", "memlock"}


def test_a_worker_that_strays_from_the_rendered_env_is_still_named():
    head, w0, w1 = rendered_nodes()
    stray = replace(w1[1], env={**w1[1].env, "NCCL_NET": "Socket"})
    findings = [f for f in judge_nodes([head, w0, (w1[0], stray, False)], "efa") if f.severity == "error"]
    assert {(f.rule, f.node) for f in findings} == {("nccl_net", "w1"), ("node_mismatch", "w1")}
    assert any("env.NCCL_NET=Socket on w1 differs from the first worker w0 (Libfabric)" in f.message for f in findings)


def test_the_head_must_still_run_the_workers_versions():
    head, w0, w1 = rendered_nodes()
    old_ray = (head[0], replace(head[1], ray="2.57.0"), True)
    findings = [f for f in judge_nodes([old_ray, w0, w1], "efa") if f.severity == "error"]
    assert [(f.node, f.message) for f in findings] == [
        ("w0", "ray=2.58.0 on w0 differs from the head (2.57.0)"), ("w1", "ray=2.58.0 on w1 differs from the head (2.57.0)")]

