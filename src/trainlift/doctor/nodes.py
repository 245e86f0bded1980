"""Run the probe once on every alive node of a Ray cluster."""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Any

from trainlift.doctor.probe import Facts, probe
from trainlift.errors import TrainliftError, UsageError

CONNECT_TIMEOUT_S = 5.0
PROBE_TIMEOUT_S = 180.0
_ADDRESS = re.compile(r"^(?:ray://)?(?P<host>\[[0-9a-fA-F:]+\]|[^:/\s]+):(?P<port>\d{1,5})$")


@dataclass
class NodeProbe:
    name: str
    node_id: str
    ip: str
    is_head: bool
    facts: Facts | None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "node_id": self.node_id, "ip": self.ip, "is_head": self.is_head,
            "facts": self.facts.to_dict() if self.facts else None, "error": self.error,
        }


def check_address(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Fail fast, with a clear message, when nothing answers at a Ray address."""
    if address == "auto":
        return
    if address.startswith(("http://", "https://")):
        raise UsageError(
            f"{address} looks like a dashboard / Jobs API address",
            hint="pass the cluster address HOST:6379 (or ray://HOST:10001)",
        )
    match = _ADDRESS.match(address)
    if not match:
        raise UsageError(f"--address {address!r} is not HOST:PORT", hint="e.g. 10.0.0.5:6379 or ray://10.0.0.5:10001")
    host, port = match.group("host").strip("[]"), int(match.group("port"))
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        raise UsageError(
            f"no Ray cluster answers at {address} ({exc.strerror or exc})",
            hint="check the address and that the head is running (ray status on the head)",
        ) from None


def connect(address: str, ship_code: bool = True, env_vars: dict[str, str] | None = None) -> None:
    """Connect this process to the cluster at `address` as a driver, shipping trainlift (and `env_vars`) to its
    workers."""
    import ray

    check_address(address)
    runtime_env: dict[str, Any] = {}
    if ship_code:
        import trainlift

        runtime_env = {"py_modules": [os.path.dirname(trainlift.__file__)], "excludes": ["__pycache__"]}
    if env_vars:
        runtime_env["env_vars"] = dict(env_vars)
    try:
        ray.init(address=address, runtime_env=runtime_env or None, logging_level="ERROR", log_to_driver=False)
    except Exception as exc:  # Ray raises several types here (connection, auth, version mismatch)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TrainliftError(f"could not connect to the Ray cluster at {address}: {first}") from None


def _probe_here() -> dict[str, Any]:
    return probe().to_dict()


def probe_nodes(timeout: float = PROBE_TIMEOUT_S) -> list[NodeProbe]:
    """Probe every alive node (a task pinned to each); the head comes first."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(_probe_here)
    nodes = sorted(
        (n for n in ray.nodes() if n.get("Alive")),
        key=lambda n: ("node:__internal_head__" not in n.get("Resources", {}), n["NodeManagerAddress"], n["NodeID"]),
    )
    refs = [
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
        for n in nodes
    ]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    out = []
    for node, ref in zip(nodes, refs):
        is_head = "node:__internal_head__" in node.get("Resources", {})
        name = f"{node['NodeManagerAddress']}/{node['NodeID'][:8]}" + (" (head)" if is_head else "")
        facts, error = None, None
        if ref not in ready:
            error = f"no answer within {timeout:.0f}s"
            ray.cancel(ref, force=True)
        else:
            try:
                facts = Facts.from_dict(ray.get(ref))
            except Exception as exc:  # the probe task failed on that node; report it, keep the others
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        out.append(NodeProbe(name, node["NodeID"], node["NodeManagerAddress"], is_head, facts, error))
    return out
