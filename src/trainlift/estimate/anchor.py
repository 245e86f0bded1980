"""Where the assumed hardware FLOP utilisation (catalog/estimate.yaml, `hfu.assumed`) comes from: torchtitan's
published Llama-3.1-8B run and the FLOPs that run executes, recomputation included.

The run: torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1: 8x H100 (500 W), FSDP, bf16, local
batch 2 x 8192, selective activation checkpointing, no torch.compile: 5,762 tokens/s/GPU.

Its checkpointing is torchtitan's selective "op" policy as of that benchmark (train_configs/llama3_8b.toml:
`selective_ac_option = 'op'`; torchtitan/parallelisms/parallelize_llama.py, `_apply_ac_to_transformer_block`,
commit 3f20451 of 2024-12-27; torchtitan/distributed/activation_checkpoint.py keeps the rule): every transformer
block is checkpointed, and within one block's forward the policy counts the `aten.mm` calls and recomputes every
second one (the 2nd, 4th, 6th), saving the others' outputs and the attention kernel's. A Llama block runs its
seven matmuls in the order wq, wk, wv, wo (attention), then w1, w3, w2 (`w2(silu(w1(x)) * w3(x))`), so wk, wo and
w3 run again in the backward pass; the LM head lies outside the blocks and runs once.
"""

from __future__ import annotations

from trainlift.estimate.shape import ModelShape

TORCHTITAN_TOKENS_PER_S_PER_GPU = 5762
TORCHTITAN_SEQ_LEN = 8192
TORCHTITAN_BLOCK_MATMULS = ("wq", "wk", "wv", "wo", "w1", "w3", "w2")  # in the order a block's forward runs them


def block_matmul_params(m: ModelShape) -> dict[str, int]:
    """The weights of one Llama block's matmuls, by torchtitan's names."""
    q_out, kv_out = m.heads * m.head_dim, m.kv_heads * m.head_dim
    return {"wq": m.hidden * q_out, "wk": m.hidden * kv_out, "wv": m.hidden * kv_out, "wo": q_out * m.hidden,
            "w1": m.hidden * m.ffn, "w3": m.hidden * m.ffn, "w2": m.ffn * m.hidden}


def recomputed_matmuls(order: tuple[str, ...] = TORCHTITAN_BLOCK_MATMULS) -> tuple[str, ...]:
    """The matmuls the op policy runs again: every second one of a block's forward."""
    return tuple(name for count, name in enumerate(order, start=1) if count % 2 == 0)


def recomputed_share(m: ModelShape) -> float:
    """The share of a block's matmul FLOPs the op policy runs again."""
    params = block_matmul_params(m)
    return sum(params[name] for name in recomputed_matmuls()) / sum(params.values())


def model_flops_per_token(m: ModelShape, seq_len: int) -> float:
    """torchtitan's count: 6 per non-embedding parameter (the LM head's included) plus 12·L·H·Q·T."""
    return 6 * (m.decoder_params + m.vocab * m.hidden) + 12 * m.layers * m.heads * m.head_dim * seq_len


def executed_flops_per_token(m: ModelShape, seq_len: int) -> float:
    """The model's FLOPs plus the recomputed matmuls' forward (2 per weight) in every block."""
    params = block_matmul_params(m)
    return model_flops_per_token(m, seq_len) + 2 * m.layers * sum(params[name] for name in recomputed_matmuls())


def torchtitan_hfu(m: ModelShape, peak_flops: float) -> float:
    """Table 1's throughput times the FLOPs it executed per token, over the GPU's peak (an H100 SXM's dense bf16:
    the catalog's p5.48xlarge)."""
    return TORCHTITAN_TOKENS_PER_S_PER_GPU * executed_flops_per_token(m, TORCHTITAN_SEQ_LEN) / peak_flops
