"""The memory estimate, item by item, against numbers worked by hand from the formulas in estimate/memory.py's
docstrings (not by the code under test): a small model whose every term is a few hundred bytes, in the settings
that take each branch (bf16 GPU / fp32 CPU, full / LoRA, sharded or kept gradients, no / selective / full
activation checkpointing keeping inputs or matmuls, dense / gated / MoE layers)."""

from __future__ import annotations

import pytest

from dataclasses import replace

from trainlift.estimate.assumptions import figure
from trainlift.estimate.memory import (GIB, Workload, _per_token_layer_bytes, _per_token_matmul_bytes,
                                       activation_bytes, checkpoint_bytes, default_runtime_bytes, loss_chunk_tokens,
                                       memory_items, model_state_bytes, runtime_sources)
from trainlift.estimate.shape import ModelShape

# d 8, 4 layers, 2 heads of 4 (1 KV head), gated MLP of 16, vocabulary 32, untied head.
# A layer: attention 8·8·2 + 8·4·2 = 192, MLP 3·8·16 = 384: 576. Whole model: 4·576 + 32·8 (embedding) + 32·8
# (head) = 2,816 parameters.
SMALL = ModelShape("llama", hidden=8, layers=4, heads=2, kv_heads=1, head_dim=4, ffn=16, vocab=32, tied=False)
# Per token of a layer, b bytes an element: norms 2·(4d + 2bd), attention b·(3·H·Q + 2·K·Q) + 4H, MLP 4·F·b
# (gated). b = 2: 128 + 72 + 128 = 328; b = 4: 192 + 136 + 256 = 584.
# Matmul outputs kept: attention b·(2·H·Q + 2·K·Q + d) + 4H, MLP b·(2F + d). b = 2: 72 + 80 = 152;
# b = 4: 136 + 160 = 296.
MOE = ModelShape("mixtral", hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, ffn=16, vocab=32, tied=True,
                 experts=4, experts_per_token=2, expert_ffn=6, shared_expert_ffn=3, moe_layers=2)
PLAIN = ModelShape("gpt2", hidden=8, layers=4, heads=2, kv_heads=1, head_dim=4, ffn=16, vocab=32, tied=True,
                   gated_mlp=False)


def test_bytes_a_token_leaves_in_a_layer():
    assert _per_token_layer_bytes(SMALL, 2) == 328 and _per_token_layer_bytes(SMALL, 4) == 584
    assert _per_token_matmul_bytes(SMALL, 2) == 152 and _per_token_matmul_bytes(SMALL, 4) == 296
    # MoE, b = 2: routed 2·(4·6·2 + 8·2) = 128, shared 4·3·2 = 24, router 8·4 = 32: 128 + 72 + 184 = 384.
    assert _per_token_layer_bytes(MOE, 2) == 384
    # Its matmul outputs: 2·(4 + 2·(2·6 + 8) + 2·3 + 8) = 116: 72 + 116 = 188.
    assert _per_token_matmul_bytes(MOE, 2) == 188
    # A plain (two-linear) MLP: 2·16·2 = 64 saved, 2·(16 + 8) = 48 of matmul outputs.
    assert _per_token_layer_bytes(PLAIN, 2) == 128 + 72 + 64 and _per_token_matmul_bytes(PLAIN, 2) == 72 + 48
    # Two KV heads: attention 2·(3·2·4 + 2·2·4) + 8 = 88 saved; 2·(2·2·4 + 2·2·4 + 8) + 8 = 88 of matmul outputs.
    gqa = replace(SMALL, kv_heads=2)
    assert _per_token_layer_bytes(gqa, 2) == 128 + 88 + 128 and _per_token_matmul_bytes(gqa, 2) == 88 + 80


def test_bf16_gpu_full_fine_tune_without_checkpointing():
    w = Workload(micro_batch=2, seq_len=8, grad_accum=1, activation_checkpointing="none", gpu=True, bf16=True,
                 workers=4)
    items = memory_items(SMALL, w, runtime_bytes=1000.0)
    assert items == {
        "parameters": 4 * 2816 / 4, "gradients": 4 * 2816 / 4, "optimizer": 8 * 2816 / 4,
        # embedding and two layers gathered in bf16, the head's bf16 gradient, a layer's bf16 + fp32 gradient
        "unsharded": 2 * (256 + 2 * 576) + 2 * 256 + 576 * (2 + 4),  # 6,784
        "loss": 14 * 32 * (12 + 2),  # 2·7 shifted tokens in one chunk: 6,272
        "activations": 4 * 328 * 16 + (4 * 8 + 2 * 2 * 8) * 16,  # four layers and the final norm: 22,016
        "runtime": 1000.0,
        "total": 2816 + 5632 + (6784 + 6272 + 22016) + 1000,  # gradients (2,816) fit in the working set's peak
    }


def test_fp32_cpu_lora_with_accumulated_gradients_and_selective_checkpointing_keeping_matmuls():
    w = Workload(micro_batch=1, seq_len=8, grad_accum=2, activation_checkpointing="selective", gpu=False,
                 bf16=False, workers=2, lora_params=102, accum_sync_last=True, checkpoint_every=2,
                 checkpoint_keeps="matmuls")
    items = memory_items(SMALL, w, runtime_bytes=1000.0)
    assert items == {
        "parameters": (4 * 102 + 4 * 2816) / 2,  # adapters in fp32 and the frozen base in fp32, sharded
        "gradients": 4 * 102,  # accumulated unsharded until the last micro-batch
        "optimizer": 8 * 102 / 2,
        "unsharded": 4 * (256 + 2 * 576) + 25 * 4,  # no head gradient; a layer's 102 // 4 adapters': 5,732
        "loss": 7 * 32 * 12,  # 7 shifted tokens: 2,688
        # layers 2 and 4 checkpointed keeping their input (4·8 a token) and matmul outputs (296), 1 and 3 whole;
        # the final norm; the 8x8 dense mask; the last layer's recompute (584 - 296 - 2,688/8 a token) is < 0.
        "activations": 2 * 584 * 8 + 2 * (4 * 8 + 296) * 8 + (4 * 8 + 2 * 4 * 8) * 8 + 64,  # 15,424
        "runtime": 1000.0,
        "total": 5836 + 408 + (5732 + 2688 + 15424) + 408 + 1000,  # accumulation keeps gradients beside it all
    }
    # Without accumulation the gradients are reduce-scattered at once: sharded, and freed before the peak.
    once = memory_items(SMALL, w.but(grad_accum=1), runtime_bytes=0.0)
    assert once["gradients"] == 4 * 102 / 2 and once["total"] == 5836 + 408 + (5732 + 2688 + 15424)


def test_fp32_cpu_full_checkpointing_on_an_hsdp_mesh_recomputes_the_last_layer_at_the_peak():
    w = Workload(micro_batch=2, seq_len=8, grad_accum=1, activation_checkpointing=True, gpu=False, bf16=False,
                 workers=8, shard=4)
    assert w.activation_checkpointing == "full" and (w.shard_group, w.replicas) == (4, 2)
    items = memory_items(SMALL, w, runtime_bytes=0.0)
    loss = 14 * 32 * 12  # 5,376
    recompute = 584 * 16 - loss  # the last layer again, once the loss's chunk is freed: 3,968
    assert items["loss"] == loss
    assert items["activations"] == 4 * (4 * 8 * 16) + (4 * 8 + 2 * 4 * 8) * 16 + 2 * 64 + recompute  # 7,680
    assert items["unsharded"] == 4 * (256 + 2 * 576) + 4 * 256 + 576 * 4  # 8,960
    assert items["total"] == 2816 + 5632 + (8960 + loss + 7680)
    assert activation_bytes(SMALL, w, loss_bytes=0.0) == 4 * 512 + 1536 + 128 + 584 * 16
    # Without checkpointing nothing is recomputed, however much larger a layer is than the loss's chunk.
    none = w.but(activation_checkpointing="none")
    assert activation_bytes(SMALL, none, loss_bytes=loss) == 4 * 584 * 16 + 1536 + 128


def test_the_loss_chunk_is_a_gpu_tile_or_the_cpu_element_budget():
    gpu = Workload(micro_batch=4, seq_len=300, grad_accum=1, activation_checkpointing="none", gpu=True, bf16=True,
                   workers=1)
    assert loss_chunk_tokens(SMALL, gpu) == 1024  # 4·299 = 1,196 shifted tokens, one 1,024-token tile at a time
    assert loss_chunk_tokens(SMALL, gpu.but(micro_batch=1)) == 299
    cpu = gpu.but(gpu=False)
    assert loss_chunk_tokens(SMALL, cpu) == 1196  # 2^25 // 32 = 1,048,576 elements allow all of them
    # A 3·2^23 vocabulary: 2^25 elements hold 1.33 tokens' logits, so one token (a whole one) at a time.
    assert loss_chunk_tokens(replace(SMALL, vocab=3 * 2**23), cpu) == 1
    assert loss_chunk_tokens(replace(SMALL, vocab=2**25 + 1), cpu) == 1  # over the budget: still one token


def test_which_layers_are_checkpointed_and_how_it_is_said():
    def w(mode, every=2, keeps="inputs"):
        return Workload(1, 8, 1, mode, gpu=True, bf16=True, workers=1, checkpoint_every=every,
                        checkpoint_keeps=keeps)

    assert [w("none").checkpointed_layers(7), w("full").checkpointed_layers(7), w("selective", 3).checkpointed_layers(7)
            ] == [0, 7, 2]
    assert [w("none").last_layer_checkpointed(6), w("full").last_layer_checkpointed(7),
            w("selective", 3).last_layer_checkpointed(7), w("selective", 3).last_layer_checkpointed(6),
            w("selective", 8).last_layer_checkpointed(7), w("selective", 2).last_layer_checkpointed(2),
            w("full").last_layer_checkpointed(1)] == [False, True, False, True, False, True, True]
    assert w(False).activation_checkpointing == "none"
    assert [w("none").describe_checkpointing(), w("full").describe_checkpointing(),
            w("selective", 3, "matmuls").describe_checkpointing()] == [
        "none", "full (every layer, keeping inputs)", "selective (1 layer in 3, keeping matmuls)"]
    assert (w("none").shard_group, w("none").replicas, w("none").but(seq_len=16, micro_batch=3).tokens) == (1, 1, 48)


def test_model_state_and_checkpoint_bytes():
    w = Workload(micro_batch=2, seq_len=8, grad_accum=4, activation_checkpointing="none", gpu=True, bf16=True,
                 workers=4, shard=2, accum_sync_last=True)
    assert model_state_bytes(SMALL, w) == (4 + 4 + 8) * 2816  # unsharded fp32 weights, gradients, two moments
    assert model_state_bytes(SMALL, w.but(lora_params=100)) == (4 * 100 + 2 * 2816) + 4 * 100 + 8 * 100
    assert checkpoint_bytes(SMALL) == 12 * 2816 and checkpoint_bytes(SMALL, lora_params=100) == 12 * 100


def test_the_runtime_is_the_cuda_context_nccl_and_allocator_slack_or_a_cpu_worker():
    cuda, nccl, slack, cpu = (figure("runtime", key).value for key in
                              ("cuda_context_gib", "nccl_gib", "allocator_slack", "cpu_worker_gib"))
    one = Workload(1, 8, 1, "none", gpu=True, bf16=True, workers=1)
    assert default_runtime_bytes(one, 1000.0) == pytest.approx(cuda * GIB + slack * 1000.0, abs=1e-6)
    assert default_runtime_bytes(one.but(workers=2), 1000.0) == pytest.approx((cuda + nccl) * GIB + slack * 1000.0,
                                                                               abs=1e-6)
    assert default_runtime_bytes(one.but(gpu=False, workers=2), 1000.0) == pytest.approx(cpu * GIB, abs=1e-6)
    items = memory_items(SMALL, one.but(workers=2))
    assert items["runtime"] == pytest.approx((cuda + nccl) * GIB + slack * (items["total"] - items["runtime"]))
    assert runtime_sources(True) == [figure("runtime", key).source
                                     for key in ("cuda_context_gib", "nccl_gib", "allocator_slack")]
    assert runtime_sources(False) == [figure("runtime", "cpu_worker_gib").source]
