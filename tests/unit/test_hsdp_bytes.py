"""bench/hsdp_bytes.py's pure helpers: the ring model, which ranks of a ring send across nodes, and the bytes
FSDP and HSDP send across 2 nodes per step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import hsdp_bytes as hb  # noqa: E402

NODES = ["a", "a", "b", "b"]


def test_ring_bytes():
    assert hb.ring_bytes("all_gather", 400, 4) == 300
    assert hb.ring_bytes("reduce_scatter", 400, 4) == 300
    assert hb.ring_bytes("all_reduce", 400, 2) == 400


def test_a_node_ordered_ring_leaves_each_node_once():
    assert hb.ring_exits([0, 1, 2, 3], NODES) == {1, 3}
    assert hb.ring_exits([0, 2], NODES) == {0, 2}
    assert hb.ring_exits([0, 1], NODES) == set()
    assert hb.ring_exits([0, 2, 1, 3], ["a", "b", "a", "b"]) == {2, 3}  # ranks interleaved over the nodes


def test_fsdp_sends_everything_across_and_hsdp_only_the_gradient_all_reduce():
    params, root = 1000, 100
    fsdp = hb.cross_node(hb.expected_step(params, root, 1, 4, 4, 4), NODES)
    assert fsdp["per_rank"] == {"all_gather": 4 * 1900 * 3 / 4, "reduce_scatter": 4 * 1000 * 3 / 4}
    assert fsdp["intra"] == 0 and fsdp["per_node"] == fsdp["cross_rank"]
    hsdp = hb.cross_node(hb.expected_step(params, root, 2, 2, 4, 4), NODES)
    assert hsdp["per_rank"] == {"all_reduce": 2 * (4 * 1000 / 2) * 1 / 2}
    assert hsdp["intra"] == 4 * 1900 / 2 + 4 * 1000 / 2
    assert hsdp["per_node"] == 2 * hsdp["cross_rank"]  # both ranks of a node are ring exits of their replicate group


def test_the_8b_figures_use_bf16_gathers_and_fp32_reductions():
    params, root = 8_000_000_000, 500_000_000
    fsdp, hsdp = hb.p5_figures(params, root, 1, 32), hb.p5_figures(params, root, 4, 8)
    assert fsdp["cross_rank"] == pytest.approx((2 * (2 * params - root) + 4 * params) * 31 / 32)
    assert hsdp["cross_rank"] == pytest.approx(2 * 4 * params / 8 * 3 / 4)
    assert fsdp["per_node"] == pytest.approx(fsdp["cross_rank"])
    assert hsdp["per_node"] == pytest.approx(8 * hsdp["cross_rank"])
    assert hsdp["node_s"] == pytest.approx(hsdp["per_node"] / 400e9)
    assert fsdp["rank_s"] == pytest.approx(fsdp["cross_rank"] / 50e9)
