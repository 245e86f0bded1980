"""Real Ray nodes for multi-node tests: each node is its own `ray start --block` process group, on loopback or
inside a network namespace, so a test can kill a whole node or cut its link.

Not a test module: tests load it with `runpy.run_path` (the test directories are not packages).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

BIN = os.path.dirname(sys.executable)
WAIT_FOR_NODES = """
import sys, time, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
deadline = time.time() + 90
while sum(n["Alive"] for n in ray.nodes()) < int(sys.argv[2]) and time.time() < deadline:
    time.sleep(0.5)
print(sum(n["Alive"] for n in ray.nodes()))
"""
# How fast the GCS declares an unreachable node dead (Ray's defaults take about half a minute).
FAST_NODE_DEATH = {"RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_period_ms": "1000",
                   "RAY_health_check_timeout_ms": "1000", "RAY_health_check_failure_threshold": "3"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra: str) -> dict[str, str]:
    """The test's environment for a private cluster: no token (it never touches the user's ~/.ray token)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "FI_", "RAY_ADDRESS"))}
    return {**base, "RAY_AUTH_MODE": "disabled", **extra}


def in_netns(netns: str | None, cmd: list[str]) -> list[str]:
    return ["ip", "netns", "exec", netns, *cmd] if netns else cmd


@dataclass
class Node:
    proc: subprocess.Popen
    log: str

    def kill(self) -> None:
        """SIGKILL the node's whole process group: raylet, workers and (on a head) the GCS."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def log_tail(self, lines: int = 20) -> str:
        with open(self.log, errors="replace") as f:
            return "".join(f.readlines()[-lines:])


def start_node(temp: str, name: str, *, head_address: str | None = None, port: int | None = None,
               ip: str = "127.0.0.1", cpus: int = 1, netns: str | None = None, **env_extra: str) -> Node:
    """A head (no head_address; listens on `port`) or a worker node joining `head_address`."""
    # Ray picks its other ports itself; these have fixed defaults that other clusters on this machine hold.
    ports = ["--dashboard-agent-listen-port", str(free_port()), "--ray-client-server-port", str(free_port())]
    cmd = [f"{BIN}/ray", "start", "--block", f"--num-cpus={cpus}", f"--node-ip-address={ip}", *ports]
    if head_address is None:
        cmd += ["--head", f"--port={port}", f"--temp-dir={temp}", "--include-dashboard=false", "--disable-usage-stats"]
    else:
        cmd += [f"--address={head_address}"]
    log = os.path.join(temp, f"{name}.out")
    proc = subprocess.Popen(in_netns(netns, cmd), env=env(**env_extra), start_new_session=True,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    node = Node(proc, log)
    if head_address is None:
        wait_for_port(node, ip, port, netns)
    return node


def wait_for_port(node: Node, ip: str, port: int, netns: str | None, timeout: float = 60) -> None:
    probe = f"import socket; socket.create_connection(({ip!r}, {port}), timeout=1).close()"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if node.proc.poll() is not None:
            raise RuntimeError(f"ray start exited: {node.log_tail()}")
        if subprocess.run(in_netns(netns, [sys.executable, "-c", probe]), capture_output=True).returncode == 0:
            return
        time.sleep(0.5)
    raise RuntimeError(f"no Ray head on {ip}:{port} after {timeout:.0f} s: {node.log_tail()}")


def wait_for_nodes(address: str, count: int, netns: str | None = None) -> None:
    alive = subprocess.run(in_netns(netns, [sys.executable, "-c", WAIT_FOR_NODES, address, str(count)]), env=env(),
                           capture_output=True, text=True, timeout=120)
    if not alive.stdout.strip().endswith(str(count)):
        raise RuntimeError(f"{count} Ray nodes did not come up: {alive.stdout[-500:]} {alive.stderr[-1500:]}")


@contextlib.contextmanager
def two_local_nodes(cpus: int = 1, head_env: dict[str, str] | None = None, worker_env: dict[str, str] | None = None):
    """A head and a worker node on loopback, `cpus` each; yields the head's address, kills both after."""
    temp = tempfile.mkdtemp(prefix="tl", dir="/tmp")  # short: Ray's unix socket paths are limited
    port = free_port()
    address, started = f"127.0.0.1:{port}", []
    try:
        started.append(start_node(temp, "head", port=port, cpus=cpus, **(head_env or {})))
        started.append(start_node(temp, "worker", head_address=address, cpus=cpus, **(worker_env or {})))
        wait_for_nodes(address, 2)
        yield address
    finally:
        for node in started:
            node.kill()
        shutil.rmtree(temp, ignore_errors=True)
