"""`doctor --address` against a real two-node Ray cluster on this machine, one node misconfigured."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

BIN = os.path.dirname(sys.executable)
WAIT_FOR_NODES = """
import sys, time, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
deadline = time.time() + 90
while sum(n["Alive"] for n in ray.nodes()) < int(sys.argv[2]) and time.time() < deadline:
    time.sleep(0.5)
print(sum(n["Alive"] for n in ray.nodes()))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ports() -> list[str]:
    # Ray picks the other ports itself; these two have fixed defaults that other clusters on this machine hold.
    return ["--dashboard-agent-listen-port", str(_free_port()), "--ray-client-server-port", str(_free_port())]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "FI_", "RAY_ADDRESS"))}
    # A private test cluster: no token, so it never touches the user's ~/.ray token.
    return {**env, "RAY_AUTH_MODE": "disabled", **extra}


@pytest.fixture(scope="module")
def two_node_cluster():
    temp = tempfile.mkdtemp(prefix="tl", dir="/tmp")  # short: Ray's unix socket paths are limited
    port = _free_port()
    address = f"127.0.0.1:{port}"
    common = ["--num-cpus=1", "--block"]
    procs = []
    try:
        procs.append(subprocess.Popen(
            [f"{BIN}/ray", "start", "--head", f"--port={port}", f"--temp-dir={temp}", "--include-dashboard=false",
             *common, *_ports()],
            env=_env(FI_PROVIDER="efa", NCCL_SOCKET_IFNAME="eth0"), start_new_session=True,
            stdout=open(os.path.join(temp, "head.out"), "w"), stderr=subprocess.STDOUT,
        ))
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)
        procs.append(subprocess.Popen(
            [f"{BIN}/ray", "start", f"--address={address}", *common, *_ports()[:2]],
            env=_env(FI_PROVIDER="sockets", NCCL_SOCKET_IFNAME="lo"), start_new_session=True,
            stdout=open(os.path.join(temp, "worker.out"), "w"), stderr=subprocess.STDOUT,
        ))
        alive = subprocess.run([sys.executable, "-c", WAIT_FOR_NODES, address, "2"], env=_env(),
                               capture_output=True, text=True, timeout=120)
        assert alive.stdout.strip().endswith("2"), alive.stdout + alive.stderr
        yield address
    finally:
        for proc in procs:  # each `ray start --block` leads its own session: its raylet, GCS and workers
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)
        shutil.rmtree(temp, ignore_errors=True)


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
    proc = subprocess.run([f"{BIN}/trainlift", "doctor", "--address", f"127.0.0.1:{_free_port()}"],
                          env=_env(), capture_output=True, text=True, timeout=30)
    assert time.time() - start <= 15
    assert proc.returncode == 2
    assert "no Ray cluster answers at 127.0.0.1:" in proc.stderr and "Traceback" not in proc.stderr
