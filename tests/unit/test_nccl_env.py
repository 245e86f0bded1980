"""The NCCL logging every trainlift-started NCCL gets (rendered workers, training, doctor fabric) is one env, and
the log file it names is the one a worker reads back."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from trainlift.config.cluster import cluster_spec_from_yaml
from trainlift.doctor.nccl_log import NCCL_DEBUG_ENV, classify_log_text, nccl_log_env
from trainlift.doctor.probe import own_nccl_log
from trainlift.render.raycluster import fabric_env

SPEC = Path(__file__).resolve().parents[2] / "examples" / "cluster-reference.yaml"


def test_rendered_workers_log_what_the_transport_check_reads():
    env = fabric_env(cluster_spec_from_yaml(SPEC.read_text()))
    assert {k: env[k] for k in NCCL_DEBUG_ENV} == NCCL_DEBUG_ENV


def test_the_log_file_nccl_writes_is_the_one_the_worker_reads_back(tmp_path):
    env = nccl_log_env(str(tmp_path / "nccl"))
    # NCCL expands %h to the host name and %p to the process id.
    path = env["NCCL_DEBUG_FILE"].replace("%h", socket.gethostname()).replace("%p", str(os.getpid()))
    Path(path).write_text("ip-10-0-0-1:1:1 [0] NCCL INFO Using network Libfabric\n")
    assert classify_log_text(own_nccl_log(str(tmp_path / "nccl"))).transport == "efa"
    assert not Path(path).exists()
