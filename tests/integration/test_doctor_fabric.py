"""`doctor fabric` on a real local Ray: two gloo workers under a TorchTrainer."""

from __future__ import annotations

import pytest

from trainlift.doctor.fabric import OPS, busbw_factor, fabric_findings, parse_sizes, run_fabric


@pytest.mark.timeout(300)
def test_two_gloo_workers_report_bandwidths_that_obey_the_nccl_tests_formulas(ray_local):
    sizes = parse_sizes("64K,1M")
    result = run_fabric(workers=2, sizes=sizes, use_gpu=False, iters=3, warmup=1)
    assert result.backend == "gloo" and result.world_size == 2 and result.nccl_log is None
    assert [(r.op, r.bytes) for r in result.rows] == [(op, size) for op in OPS for size in sizes]
    for row in result.rows:
        assert row.time_us > 0 and row.algbw_gbps > 0 and row.busbw_gbps > 0
        assert row.algbw_gbps == pytest.approx(row.bytes / (row.time_us * 1e-6) / 1e9)
        factor = 2 * (2 - 1) / 2 if row.op == "all_reduce" else (2 - 1) / 2
        assert busbw_factor(row.op, 2) == factor
        assert row.busbw_gbps == pytest.approx(row.algbw_gbps * factor)
    [finding] = fabric_findings(result, None, None)
    assert finding.severity == "ok" and "gloo" in finding.message
