"""The worker-side transport check on recorded NCCL logs (real log text: see tests/fixtures/nccl_logs/README.md).

No GPU or EFA device exists here, so the log a worker would write is planted
where NCCL_DEBUG_FILE=<prefix>.%h.%p.log would put it for this process.
"""

import os
from pathlib import Path

import pytest

from trainlift.train.run.preflight import PreflightError, check_transport

LOGS = Path(__file__).resolve().parents[1] / "fixtures" / "nccl_logs"


def plant(tmp_path, fixture: str) -> str:
    prefix = str(tmp_path / "nccl")
    Path(f"{prefix}.host1.{os.getpid()}.log").write_text((LOGS / fixture).read_text())
    return prefix


def test_efa_expected_and_used_passes(tmp_path):
    assert check_transport(plant(tmp_path, "efa_gdrdma_p4d.log"), "efa") == "efa"


def test_socket_fallback_when_efa_expected_stops_the_run(tmp_path):
    fallback = next(p.name for p in LOGS.glob("*.log") if p.name.startswith("socket"))
    with pytest.raises(PreflightError, match="NCCL chose the socket transport, not EFA"):
        check_transport(plant(tmp_path, fallback), "efa")


def test_any_fabric_accepts_sockets(tmp_path):
    fallback = next(p.name for p in LOGS.glob("*.log") if p.name.startswith("socket"))
    assert check_transport(plant(tmp_path, fallback), "any") == "socket"


def test_gpu_workers_get_expandable_allocator_segments_unless_the_driver_sets_its_own():
    from trainlift.train.launch import allocator_env

    assert allocator_env(True, {}) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert allocator_env(True, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}) == {}
    assert allocator_env(False, {}) == {}
