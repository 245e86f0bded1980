"""`doctor --address` against a real two-node Ray cluster on this machine, one node misconfigured."""

from __future__ import annotations

import json
import runpy
import subprocess
import time
from pathlib import Path

import pytest

nodes = runpy.run_path(str(Path(__file__).with_name("ray_nodes.py")))
BIN = nodes["BIN"]
_env = nodes["env"]


@pytest.fixture(scope="module")
def two_node_cluster():
    with nodes["two_local_nodes"](head_env={"FI_PROVIDER": "efa", "NCCL_SOCKET_IFNAME": "eth0"},
                                  worker_env={"FI_PROVIDER": "sockets", "NCCL_SOCKET_IFNAME": "lo"}) as address:
        yield address


@pytest.mark.timeout(300)
def test_every_node_is_probed_once_and_the_misconfigured_node_is_named(two_node_cluster):
    proc = subprocess.run(
        [f"{BIN}/trainlift", "doctor", "--address", two_node_cluster, "--json"],
        env=_env(), capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    nodes = report["nodes"]
    assert len(nodes) == 2 and len({n["node_id"] for n in nodes}) == 2
    head, worker = nodes
    assert head["is_head"] and not worker["is_head"] and "(head)" in head["name"]
    assert head["facts"]["env"]["FI_PROVIDER"] == "efa" and worker["facts"]["env"]["FI_PROVIDER"] == "sockets"
    mismatches = [f for f in report["findings"] if f["rule"] == "node_mismatch"]
    assert {f["node"] for f in mismatches} == {worker["name"]}
    assert all(f["severity"] == "error" for f in mismatches)
    text = " | ".join(f["message"] for f in mismatches)
    assert f"env.FI_PROVIDER=sockets on {worker['name']} differs from the head (efa)" in text
    assert f"env.NCCL_SOCKET_IFNAME=lo on {worker['name']} differs from the head (eth0)" in text
    assert set(report["differences"]) == {"env.FI_PROVIDER", "env.NCCL_SOCKET_IFNAME"}


@pytest.mark.timeout(60)
def test_an_unreachable_address_fails_fast_with_a_clear_error():
    start = time.time()
    proc = subprocess.run([f"{BIN}/trainlift", "doctor", "--address", f"127.0.0.1:{nodes['free_port']()}"],
                          env=_env(), capture_output=True, text=True, timeout=30)
    assert time.time() - start <= 15
    assert proc.returncode == 2
    assert "no Ray cluster answers at 127.0.0.1:" in proc.stderr and "Traceback" not in proc.stderr
