"""Fabric arithmetic and judgement (pure), and the emulated reduce_scatter on real gloo processes."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainlift.doctor.probe import own_nccl_log
from trainlift.doctor.fabric import (
    EMULATED_RS,
    FabricResult,
    FabricRow,
    busbw_factor,
    fabric_findings,
    parse_sizes,
    reduce_scatter_emulated,
)
from trainlift.doctor.nccl_log import classify_log_text
from trainlift.errors import UsageError


def test_parse_sizes_uses_binary_units():
    assert parse_sizes("1M,16M,128M") == [2**20, 16 * 2**20, 128 * 2**20]
    assert parse_sizes("512, 4K ,1G") == [512, 4096, 2**30]
    for bad in ("", "1X", "M", "0M", "1.5M"):
        with pytest.raises(UsageError):
            parse_sizes(bad)


def test_busbw_factors_follow_nccl_tests():
    assert busbw_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert busbw_factor("all_gather", 8) == pytest.approx(7 / 8)
    assert busbw_factor("reduce_scatter", 2) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        busbw_factor("broadcast", 2)


def result(busbw: float, world: int = 16, backend: str = "nccl", log: str | None = None) -> FabricResult:
    rows = [
        FabricRow("all_reduce", 2**20, world, 10.0, busbw, busbw),
        FabricRow("all_reduce", 128 * 2**20, world, 10.0, busbw, busbw),
        FabricRow("reduce_scatter", 2**20, world, 10.0, 1.0, 1.0),
    ]
    return FabricResult(backend, world, rows, classify_log_text(log) if log is not None else None)


def test_below_the_floor_is_an_error_naming_tcp_fallback():
    [f] = fabric_findings(result(3.0), "g6.12xlarge", 6.25)
    assert f.severity == "error" and "TCP fallback" in f.message and "g6.12xlarge" in f.message


def test_at_or_above_the_floor_is_ok():
    [f] = fabric_findings(result(9.0), "g6.12xlarge", 6.25)
    assert f.severity == "ok" and "meets" in f.message


def test_a_given_floor_is_named_as_given_and_judged_like_the_catalog_floor():
    [low] = fabric_findings(result(0.004, backend="gloo"), None, 0.05, floor_from="given")
    assert low.severity == "error" and "below the given floor 0.05 GB/s" in low.message
    [high] = fabric_findings(result(0.3, backend="gloo"), None, 0.05, floor_from="given")
    assert high.severity == "ok" and "meets the given floor" in high.message


def test_without_a_floor_the_bandwidth_is_reported_not_judged():
    [f] = fabric_findings(result(0.5, backend="gloo"), None, None)
    assert f.severity == "ok" and "no floor" in f.message and f.fix


def test_one_worker_cannot_measure_bus_bandwidth():
    [f] = fabric_findings(result(0.0, world=1), "g6.12xlarge", 6.25)
    assert f.severity == "warning"


def test_nccl_on_sockets_on_an_efa_instance_is_an_error():
    log = "h:1:1 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.1<0>\nh:1:1 [0] NCCL INFO Using network Socket\n"
    findings = {f.rule: f for f in fabric_findings(result(9.0, log=log), "g6.12xlarge", 6.25, efa_interfaces=1)}
    assert findings["fabric_transport"].severity == "error" and "socket" in findings["fabric_transport"].message
    log = "h:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Libfabric/0\n"
    findings = {f.rule: f for f in fabric_findings(result(9.0, log=log), "g6.12xlarge", 6.25, efa_interfaces=1)}
    assert findings["fabric_transport"].severity == "ok" and "efa" in findings["fabric_transport"].message


def test_emulated_rows_are_labelled():
    r = result(9.0)
    r.rows[2].method = EMULATED_RS
    assert any(f.rule == "fabric_method" for f in fabric_findings(r, None, None))


def test_a_worker_collects_only_itsown_nccl_log(tmp_path):
    prefix = str(tmp_path / "nccl")
    mine = tmp_path / f"nccl.ip-10-0-0-1.{os.getpid()}.log"
    mine.write_text("ip-10-0-0-1:1:1 [0] NCCL INFO Using network Libfabric\n")
    other = tmp_path / f"nccl.ip-10-0-0-1.{os.getpid() + 1}.log"
    other.write_text("someone else\n")
    assert own_nccl_log(prefix) == "ip-10-0-0-1:1:1 [0] NCCL INFO Using network Libfabric\n"
    assert not mine.exists() and other.exists()
    assert own_nccl_log(None) == ""


def _emulated_worker(rank: int, world: int, store: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    inp = torch.arange(8, dtype=torch.float32) * (rank + 1)
    got = torch.empty(8 // world)
    reduce_scatter_emulated(got, inp)
    native = torch.empty(8 // world)
    dist.reduce_scatter_single(native, inp) if hasattr(dist, "reduce_scatter_single") else dist.reduce_scatter_tensor(native, inp)
    out[rank] = (got.tolist(), native.tolist())
    dist.destroy_process_group()


def test_emulated_reduce_scatter_matches_the_native_op_on_gloo(tmp_path):
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_emulated_worker, args=(2, str(tmp_path / "store"), out), nprocs=2, start_method="fork")
        results = dict(out)
    for got, native in results.values():
        assert got == native
    assert results[0][0] == [0.0, 3.0, 6.0, 9.0] and results[1][0] == [12.0, 15.0, 18.0, 21.0]
