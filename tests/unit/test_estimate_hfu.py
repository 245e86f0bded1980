"""The assumed HFU is torchtitan's Table 1 throughput at the FLOPs that run executes: its selective "op" policy
recomputes every second matmul of a block's forward (wk, wo and w3 of a Llama block), not every second matmul of
the whole decoder's weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainlift import catalog
from trainlift.estimate import anchor, assumptions
from trainlift.estimate.shape import shape_of
from trainlift.ops.model_config import read_config_file

REPO = Path(__file__).resolve().parents[2]


def llama_8b():
    return shape_of(read_config_file(REPO / "examples" / "model-configs" / "llama-3.1-8b.json"))


def test_the_op_policy_recomputes_the_second_fourth_and_sixth_matmul_of_a_llama_block():
    assert anchor.recomputed_matmuls() == ("wk", "wo", "w3")
    assert anchor.recomputed_matmuls(("a", "b", "c", "d", "e")) == ("b", "d")


def test_llama_31_8b_by_hand():
    m = llama_8b()
    # One block: wq 4096x4096 = 16,777,216; wk and wv 4096x1024 = 4,194,304 each; wo 16,777,216;
    # w1, w3, w2 4096x14336 = 58,720,256 each: 218,103,808 in all. Run again: wk + wo + w3 = 79,691,776.
    assert sum(anchor.block_matmul_params(m).values()) == 218_103_808
    assert anchor.recomputed_share(m) == pytest.approx(79_691_776 / 218_103_808)  # 36.5%
    # Model FLOPs: 6 x (32 blocks x 218,103,808 + the LM head 128,256 x 4096) + 12 x 32 x 32 x 128 x 8192.
    model = 6 * (32 * 218_103_808 + 128_256 * 4096) + 12 * 32 * 32 * 128 * 8192
    assert anchor.model_flops_per_token(m, 8192) == model == 57_912_852_480
    # Executed: plus the recomputed matmuls' forward, 2 x 32 x 79,691,776 = 5,100,273,664.
    executed = model + 2 * 32 * 79_691_776
    assert anchor.executed_flops_per_token(m, 8192) == executed == 63_013_126_144
    # 5,762 tokens/s/GPU x 63.01 GFLOPs/token over 989 TFLOP/s.
    hfu = anchor.torchtitan_hfu(m, 989e12)
    assert hfu == pytest.approx(5762 * executed / 989e12) and hfu == pytest.approx(0.3671, abs=1e-4)


def test_the_catalog_assumes_the_derived_figure():
    peak = catalog.lookup("p5.48xlarge").peak_bf16_flops_per_gpu
    figure, measured = assumptions.hfu(None)
    assert not measured and figure.value == round(anchor.torchtitan_hfu(llama_8b(), peak), 3) == 0.367
    assert "wk, wo and w3" in figure.source and "36.7%" in figure.source
