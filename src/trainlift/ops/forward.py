"""The Ray head's dashboard (Jobs API) reached from this machine through `kubectl port-forward`: the head's
Service is ClusterIP only, so nothing else exposes it."""

from __future__ import annotations

import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from trainlift.errors import TrainliftError, UsageError
from trainlift.ops import kube
from trainlift.ops.run import Background
from trainlift.ops.steps import DASHBOARD_PORT

WAIT_S = 60.0


def forward_argv(kubeconfig: str, namespace: str, cluster: str, port: int) -> list[str]:
    return kube.kubectl(kubeconfig, "-n", namespace, "port-forward", f"svc/{cluster}-head-svc",
                        f"{port}:{DASHBOARD_PORT}")


def wait_for_port(forward: Background, port: int, wait_s: float = WAIT_S) -> None:
    """Until the forwarded port accepts a connection; one line with kubectl's words if it never does."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            return
        except OSError:
            if not forward.alive() or time.monotonic() > deadline:
                said = " ".join(forward.stop().split())[-300:] or f"no answer on port {port} after {wait_s:.0f} s"
                raise TrainliftError(f"port-forward to the Ray head failed: {said}",
                                     hint="check that the RayCluster's head pod is Running: trainlift cluster status")
            time.sleep(0.5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def head_dashboard(kubeconfig: Path, namespace: str, cluster: str) -> Iterator[str]:
    """The head's dashboard URL on this machine while the block runs."""
    if not kubeconfig.is_file():
        raise UsageError(f"no kubeconfig at {kubeconfig}: the cluster's files are written by `trainlift cluster up`",
                         hint="run `trainlift cluster up CLUSTER_SPEC` here first, or pass --address")
    port = free_port()
    with Background(forward_argv(str(kubeconfig), namespace, cluster, port)) as forward:
        wait_for_port(forward, port)
        yield f"http://127.0.0.1:{port}"
