"""Rules over fact fixtures: every rule, in its passing and failing outcome."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainlift.doctor.probe import Facts
from trainlift.doctor.rules import (
    STACK_RULES,
    cross_node_rules,
    differences,
    has_errors,
    known_good,
    sort_findings,
    stack_rules,
    version_tuple,
)

GiB = 1024**3
PLUGIN = "/opt/amazon/ofi-nccl/lib64/libnccl-net-ofi.so"


MLFLOW_OK = {"uri": "https://mlflow.example", "credentials": ["MLFLOW_TRACKING_TOKEN"], "status": 200, "error": None}


def dlc_node(**changes) -> Facts:
    """A GPU node running the Ray Train DLC v1.1 stack, set up as the EFA docs ask."""
    facts = Facts(
        hostname="ip-10-0-0-1", instance_type="g6.12xlarge", python="3.13.1", torch="2.13.0+cu130",
        torch_cuda="13.0", torch_cudnn="91200", torch_nccl="2.29.7", ray="2.58.0", transformers="5.13.0",
        gpu_count=4, gpu_model="NVIDIA L4", driver="580.65.06", driver_cuda="13.0",
        ofi_plugin=PLUGIN, ofi_plugin_candidates=[PLUGIN], ofi_plugin_on_ld_path=True, ofi_plugin_version="1.20.0",
        libfabric="2.3.0amzn1.0", efa_installer="1.49.0", fi_info_efa="ok", fi_info_detail="provider: efa",
        uverbs=["/dev/infiniband/uverbs0"], memlock_bytes=None, shm_bytes=64 * GiB,
        env={"FI_PROVIDER": "efa", "NCCL_NET": "Libfabric", "NCCL_SOCKET_IFNAME": "eth0",
             "LD_LIBRARY_PATH": "/opt/amazon/ofi-nccl/lib64:/opt/amazon/efa/lib"},
        mlflow=MLFLOW_OK,
    )
    return replace(facts, **changes)


def laptop(**changes) -> Facts:
    facts = Facts(hostname="laptop", python="3.11.7", torch="2.13.0+cpu", ray="2.60.0", transformers="5.24.0",
                  memlock_bytes=8 * 1024**2, shm_bytes=16 * GiB, fi_info_efa="absent")
    return replace(facts, **changes)


def finding(facts: Facts, rule: str, expect: str = "efa"):
    found = [f for f in stack_rules(facts, expect) if f.rule == rule]
    assert len(found) <= 1
    return found[0] if found else None


def test_a_well_set_up_efa_node_passes_every_rule():
    findings = stack_rules(dlc_node(), "efa")
    assert {f.rule for f in findings} == {r.__name__ for r in STACK_RULES}
    assert [f for f in findings if f.severity != "ok"] == []
    assert not has_errors(findings)


CASES = [
    # rule, facts changes, expect, severity, words in the message
    ("efa_device", {"uverbs": []}, "efa", "error", "no EFA device"),
    ("fi_info_efa", {"fi_info_efa": "absent"}, "efa", "error", "fi_info not found"),
    ("fi_info_efa", {"fi_info_efa": "no-efa", "fi_info_detail": "fi_getinfo: -61 (No data available)"}, "efa", "error", "-61"),
    ("ofi_plugin", {"ofi_plugin": None, "ofi_plugin_candidates": []}, "efa", "error", "no aws-ofi-nccl plugin"),
    ("ofi_plugin", {"ofi_plugin_on_ld_path": False}, "efa", "error", "LD_LIBRARY_PATH"),
    ("ofi_plugin", {"ofi_plugin_on_ld_path": False}, "any", "warning", "LD_LIBRARY_PATH"),
    ("ofi_plugin_deps", {"ofi_plugin_missing_deps": ["libfabric.so.1"]}, "efa", "error", "libfabric.so.1"),
    ("nccl_net", {"env": {"FI_PROVIDER": "efa"}}, "efa", "warning", "silently fall back"),
    ("nccl_net", {"env": {"NCCL_NET": "Socket"}}, "efa", "error", "NCCL_NET=Socket"),
    ("nccl_net", {}, "socket", "warning", "pins the EFA plugin"),
    ("fi_provider", {"env": {"FI_PROVIDER": "sockets", "NCCL_NET": "Libfabric"}}, "efa", "error", "FI_PROVIDER=sockets"),
    ("shm", {"shm_bytes": 64 * 1024**2}, "efa", "error", "64 MiB"),
    ("shm", {"shm_bytes": 64 * 1024**2, "gpu_count": 1}, "any", "warning", "64 MiB"),
    ("shm", {"shm_bytes": None}, "any", "warning", "missing"),
    ("memlock", {"memlock_bytes": 64 * 1024}, "efa", "error", "memlock limited"),
    ("memlock", {"memlock_bytes": 64 * 1024}, "any", "warning", "memlock limited"),
    ("memlock", {"memlock_bytes": 64 * 1024}, "socket", "ok", "memlock limited"),
    ("memlock", {"memlock_bytes": 64 * 1024, "uverbs": [], "fi_info_efa": "absent"}, "any", "ok", "no EFA device"),
    ("cuda_driver", {"driver": "535.104.12", "driver_cuda": "12.2"}, "efa", "error", "newer than driver"),
    ("cuda_driver", {"driver": "575.51.03", "driver_cuda": None}, "efa", "error", "newer than driver"),
    ("cuda_driver", {"torch": "2.13.0+cpu", "torch_cuda": None}, "efa", "error", "CPU build"),
    ("nccl_version", {"torch_nccl": "2.10.3"}, "efa", "error", "older than aws-ofi-nccl supports"),
    ("nccl_version", {"torch_nccl": None}, "efa", "warning", "no NCCL"),
    ("libfabric_version", {"libfabric": "1.18.0amzn1.0"}, "efa", "warning", "older than aws-ofi-nccl"),
    ("legacy_env", {"env": {"NCCL_NET": "Libfabric", "RDMAV_FORK_SAFE": "1"}}, "efa", "warning", "RDMAV_FORK_SAFE"),
    ("legacy_env", {"env": {"NCCL_NET": "Libfabric", "FI_EFA_USE_DEVICE_RDMA": "1"}}, "efa", "warning", "old plugin"),
    ("known_stack", {"torch_nccl": "2.27.3"}, "efa", "warning", "not a known-good combination"),
    ("mlflow_access", {"mlflow": {**MLFLOW_OK, "credentials": [], "status": 401}}, "any", "error", "needs credentials"),
    ("mlflow_access", {"mlflow": {**MLFLOW_OK, "status": 403}}, "any", "error", "refuses the credentials"),
    ("mlflow_access", {"mlflow": {**MLFLOW_OK, "status": None, "error": "timed out"}}, "any", "warning", "timed out"),
    ("mlflow_access", {"mlflow": {**MLFLOW_OK, "status": 404}}, "any", "warning", "HTTP 404"),
]


@pytest.mark.parametrize("rule,changes,expect,severity,words", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_rule_outcomes(rule, changes, expect, severity, words):
    f = finding(dlc_node(**changes), rule, expect)
    assert f is not None and f.severity == severity, f
    assert words in f.message
    if severity != "ok":
        assert f.fix


def test_every_rule_has_a_failing_case():
    assert {c[0] for c in CASES if c[3] != "ok"} == {r.__name__ for r in STACK_RULES}


def test_a_cpu_laptop_reports_the_missing_efa_stack_only_when_efa_is_expected():
    assert not has_errors(stack_rules(laptop(), "any"))
    assert not has_errors(stack_rules(laptop(), "socket"))
    errors = {f.rule for f in stack_rules(laptop(), "efa") if f.severity == "error"}
    assert errors == {"efa_device", "fi_info_efa", "ofi_plugin", "memlock"}


def test_cuda_driver_without_a_driver_is_a_cpu_node_and_ok():
    assert finding(dlc_node(driver=None, driver_cuda=None, gpu_count=0), "cuda_driver").severity == "ok"


def test_known_stack_names_the_closest_combination():
    f = finding(dlc_node(torch_nccl="2.27.3"), "known_stack")
    assert "train-ml-cuda-v1.1" in f.fix and "torch_nccl 2.27.3 vs 2.29.7" in f.fix
    assert "train-ml-cuda-v1.1" in finding(dlc_node(), "known_stack").message


def test_rules_reject_an_unknown_expectation():
    with pytest.raises(ValueError):
        stack_rules(dlc_node(), "carrier-pigeon")


def test_findings_sort_errors_first():
    findings = sort_findings(stack_rules(laptop(), "efa"))
    severities = [f.severity for f in findings]
    assert severities == sorted(severities, key=["error", "warning", "ok"].index)


def test_version_tuple_reads_real_version_strings():
    assert version_tuple("2.13.0+cu130") == (2, 13, 0)
    assert version_tuple("1.22.0amzn4.0") == (1, 22, 0)
    assert version_tuple("1.11.0-aws") == (1, 11, 0)
    assert version_tuple("v1.16.3") == (1, 16, 3)
    assert version_tuple(None) == ()


def test_known_good_data_names_its_sources():
    data = known_good()
    for section in ("cuda_driver_min", "ofi_plugin", "shm"):
        assert data[section]["source"].strip()
    assert data["stacks"] and all(stack["source"].strip() for stack in data["stacks"])


# --- across nodes


def test_identical_nodes_agree():
    nodes = [("head", dlc_node()), ("w1", dlc_node(hostname="ip-10-0-0-2"))]
    assert differences(nodes) == {}
    assert [f.severity for f in cross_node_rules(nodes)] == ["ok"]


def test_a_differing_env_or_version_is_an_error_naming_the_node():
    head = dlc_node()
    worker_env = {**head.env, "FI_PROVIDER": "sockets"}
    worker_env.pop("NCCL_SOCKET_IFNAME")
    nodes = [("head", head), ("w1", dlc_node()), ("w2", dlc_node(env=worker_env, torch_nccl="2.27.3"))]
    findings = cross_node_rules(nodes)
    assert all(f.severity == "error" and f.node == "w2" for f in findings)
    messages = " | ".join(f.message for f in findings)
    assert "env.FI_PROVIDER=sockets on w2 differs from the head (efa)" in messages
    assert "env.NCCL_SOCKET_IFNAME=unset on w2 differs from the head (eth0)" in messages
    assert "torch_nccl=2.27.3 on w2" in messages
    assert set(differences(nodes)) == {"env.FI_PROVIDER", "env.NCCL_SOCKET_IFNAME", "torch_nccl"}


def test_ld_library_path_is_not_compared_across_nodes():
    head = dlc_node()
    other = dlc_node(env={**head.env, "LD_LIBRARY_PATH": "/elsewhere"})
    assert differences([("head", head), ("w1", other)]) == {}


def test_a_single_node_has_no_cross_node_findings():
    assert cross_node_rules([("head", dlc_node())]) == []
