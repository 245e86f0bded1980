"""`trainlift estimate`'s arithmetic: model sizes from configs, memory items, FLOPs, step time, advice."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from trainlift import catalog
from trainlift.config.job import validate_job_spec
from trainlift.estimate import assumptions
from trainlift.estimate.memory import CHUNK_ELEMENTS, GPU_CHUNK_TOKENS, Workload, memory_items
from trainlift.estimate.plan import Target, plan
from trainlift.estimate.shape import shape_of
from trainlift.estimate.timing import (Fabric, collective_bytes_per_step, model_flops_per_token,
                                      replica_bytes_per_step, step_timing)
from trainlift.train.model import loss
from trainlift.train.model.build import step_flops

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False)
# Tiny members of each family the estimate sizes; MoE with few experts.
FAMILIES = {
    "llama": {}, "qwen2": {}, "qwen3": {"head_dim": 16}, "mistral": {}, "gemma": {"head_dim": 16},
    "gemma2": {"head_dim": 16}, "gemma3_text": {"head_dim": 16}, "phi3": {"pad_token_id": 0}, "gpt_neox": {"rotary_pct": 1.0, "num_key_value_heads": 4},  # no grouped-query attention
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 96},
}


def small_shape(**changes):
    return shape_of(AutoConfig.for_model("llama", **{**SMALL, **changes}))


def meta_params(config) -> int:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_the_parameter_count_from_the_config_matches_the_model_transformers_builds(model_type):
    config = AutoConfig.for_model(model_type, **{**SMALL, "hidden_size": 128, **FAMILIES[model_type]})
    counted, built = shape_of(config).params, meta_params(config)
    # Biases and norm weights are left out: 2% of a model this small, under 0.1% of a real one.
    assert abs(counted - built) / built < 0.02, (counted, built)


def test_a_small_config_by_hand():
    m = small_shape()
    attention = 64 * 64 * 2 + 64 * 32 * 2  # q, o: 64x(4 heads x 16); k, v: 64x(2 x 16)
    mlp = 3 * 64 * 128
    assert m.layer_params == attention + mlp == 36864
    assert m.params == 2 * 36864 + 2 * 1000 * 64
    assert m.lora_params(8, "all-linear") == 2 * 8 * ((64 + 64) * 2 + (64 + 32) * 2 + (64 + 128) * 3)
    assert m.lora_params(8, ["q_proj", "v_proj"]) == 2 * 8 * ((64 + 64) + (64 + 32))


def test_memory_items_of_a_small_config_by_hand_full_fine_tuning_on_gpus():
    m = small_shape()
    w = Workload(micro_batch=2, seq_len=32, grad_accum=1, activation_checkpointing=False, gpu=True, bf16=True,
                 workers=2)
    items = memory_items(m, w, runtime_bytes=0)
    p = 2 * 36864 + 128000
    assert items["parameters"] == 4 * p / 2
    assert items["gradients"] == 4 * p / 2
    assert items["optimizer"] == 8 * p / 2
    # bf16: the LM head and two layers gathered, the head's gradient, one layer's gradient in bf16 and fp32
    assert items["unsharded"] == 2 * (64000 + 2 * 36864) + 2 * 64000 + 36864 * 6
    # 62 shifted tokens of fp32 logits over 1000 words, their bf16 original, log-softmax and two gradients
    assert items["loss"] == 62 * 1000 * 14
    per_token_layer = 2 * (4 * 64 + 2 * 2 * 64) + 2 * (3 * 64 + 2 * 32) + 4 * 4 + 4 * 128 * 2
    assert items["activations"] == 64 * (2 * per_token_layer + (4 * 64 + 4 * 64))
    working = items["unsharded"] + items["loss"] + items["activations"]
    assert items["total"] == items["parameters"] + items["optimizer"] + max(working, items["gradients"])


def test_lora_keeps_the_frozen_base_in_the_compute_dtype_and_trains_only_the_adapters():
    m = small_shape()
    lora = m.lora_params(8, "all-linear")
    w = Workload(2, 32, 1, False, gpu=True, bf16=True, workers=2, lora_params=lora)
    items = memory_items(m, w, runtime_bytes=0)
    assert items["parameters"] == (4 * lora + 2 * m.params) / 2
    assert items["gradients"] == 4 * lora / 2 and items["optimizer"] == 8 * lora / 2


def test_hsdp_shards_the_state_over_a_shard_group_and_all_reduces_gradient_shards_across_replicas():
    m = small_shape()
    w = Workload(2, 32, 1, False, gpu=True, bf16=True, workers=8, shard=4)
    items = memory_items(m, w, runtime_bytes=0)
    assert (w.replicas, w.shard_group) == (2, 4)
    assert items["parameters"] == 4 * m.params / 4 and items["optimizer"] == 8 * m.params / 4
    assert collective_bytes_per_step(m, w) == (2 * 2 * m.params + 4 * m.params) * 3 / 4  # bf16 gathers twice, fp32 reduce
    assert replica_bytes_per_step(m, w) == 4 * m.params / 4 * 2 * 1 / 2
    # Four micro-batches: each reduce-scatters within the node, only the last all-reduces across nodes.
    w4 = Workload(2, 32, 4, False, gpu=True, bf16=True, workers=8, shard=4)
    assert replica_bytes_per_step(m, w4) == replica_bytes_per_step(m, w)
    assert collective_bytes_per_step(m, w4) > collective_bytes_per_step(m, w)
    timing = step_timing(m, w, Fabric(peak_flops=1e18, hfu=1.0, busbw_gbps=100, replica_busbw_gbps=1))
    assert timing.comm_s == pytest.approx(collective_bytes_per_step(m, w) / 100e9 + replica_bytes_per_step(m, w) / 1e9)


def test_the_estimate_picks_the_mesh_the_recipe_would():
    """train.run.mesh's rule: a 1.5B model's state fits one g6.12xlarge node, a 70B one does not fit one p5."""
    spec = job(data={"train": "t.jsonl", "seq_len": 2048}, train={"micro_batch_size": 1})
    qwen = shape_of(AutoConfig.for_model("qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936))
    two_g6 = plan(spec, qwen, Target(catalog.lookup("g6.12xlarge"), 2))
    assert (two_g6.mesh.replicate, two_g6.mesh.shard) == (2, 4) and two_g6.workload.shard_group == 4
    four_p5 = plan(spec, llama_70b(), Target(catalog.lookup("p5.48xlarge"), 4))
    assert (four_p5.mesh.replicate, four_p5.mesh.shard) == (1, 32)
    checkpointed = {"config": {"model_type": "llama"}, "tokenizer": "t", "activation_checkpointing": True}
    forced = plan(job(parallel={"shard": 8}, model=checkpointed, data={"train": "t.jsonl", "seq_len": 2048}),
                  llama_70b(), Target(catalog.lookup("p5.48xlarge"), 4))
    assert not forced.fits and (forced.mesh.replicate, forced.mesh.shard) == (4, 8)
    assert any(a.change.startswith("parallel.replicate: 1") and a.fits for a in forced.advice)


def test_gradient_accumulation_keeps_gradients_and_syncing_at_the_last_micro_batch_keeps_them_whole():
    m = small_shape()
    every = memory_items(m, Workload(2, 32, 4, False, gpu=False, bf16=False, workers=2), runtime_bytes=0)
    last = memory_items(m, Workload(2, 32, 4, False, gpu=False, bf16=False, workers=2, accum_sync_last=True),
                        runtime_bytes=0)
    assert last["gradients"] == 2 * every["gradients"] == 4 * m.params
    working = every["unsharded"] + every["loss"] + every["activations"]
    assert every["total"] == every["parameters"] + every["optimizer"] + working + every["gradients"]


def test_activation_checkpointing_keeps_layer_inputs_and_one_recomputed_layer():
    m = small_shape(num_hidden_layers=8)
    plain = Workload(4, 256, 1, False, gpu=True, bf16=True, workers=1)
    items, checkpointed = memory_items(m, plain, 0), memory_items(m, plain.but(activation_checkpointing=True), 0)
    assert checkpointed["activations"] < items["activations"] / 3
    assert checkpointed["activations"] >= 8 * 2 * 64 * 1024


def test_the_estimate_uses_the_recipes_loss_chunks():
    assert (CHUNK_ELEMENTS, GPU_CHUNK_TOKENS) == (loss.CHUNK_ELEMENTS, loss.GPU_CHUNK_TOKENS)


def test_flops_per_token_of_qwen2_5_1_5b_is_the_catalogs_figure():
    """shared/FACTS.md: about 10.3 GFLOPs/token at T = 2048 for Qwen2.5-1.5B (tied embeddings)."""
    config = AutoConfig.for_model("qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                  num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                  tie_word_embeddings=True)
    w = Workload(1, 2048, 1, False, gpu=True, bf16=True, workers=8)
    assert model_flops_per_token(shape_of(config), w) / 1e9 == pytest.approx(10.3, abs=0.05)


def test_flops_per_token_agree_with_the_recipes_count_on_the_built_model():
    config = AutoConfig.for_model("llama", **SMALL)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    w = Workload(1, 128, 1, False, gpu=True, bf16=True, workers=1)
    recipe = step_flops(model).per_token(128)
    assert model_flops_per_token(shape_of(config), w) == pytest.approx(recipe, rel=0.01)


def test_step_time_is_the_longer_of_compute_and_collectives():
    m = small_shape()
    w = Workload(1, 128, 2, False, gpu=True, bf16=True, workers=4)
    moved = collective_bytes_per_step(m, w)
    assert moved == (2 * (2 * 2 * m.params) + 2 * 4 * m.params) * 3 / 4
    slow = step_timing(m, w, Fabric(peak_flops=1e15, hfu=0.5, busbw_gbps=1e-3))
    assert slow.step_s == slow.comm_s == pytest.approx(moved / 1e6)
    fast = step_timing(m, w, Fabric(peak_flops=1e9, hfu=0.5, busbw_gbps=1e3))
    # the GPUs also run the LM head's forward again: the chunked loss recomputes each chunk's logits
    executed = model_flops_per_token(m, w) + 2 * m.vocab * m.hidden
    assert fast.step_s == fast.compute_s == pytest.approx(256 * executed / 5e8)
    assert fast.tokens_per_s_per_gpu == pytest.approx(256 / fast.step_s)


def job(**sections):
    base = {"model": {"config": {"model_type": "llama", **SMALL}, "tokenizer": "t"},
            "data": {"train": "t.jsonl", "seq_len": 512}, "scaling": {"workers": "auto"}}
    return validate_job_spec({**base, **sections})


def llama_70b():
    return shape_of(AutoConfig.for_model("llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                         num_attention_heads=64, num_key_value_heads=8, vocab_size=128256))


def test_a_70b_full_fine_tune_does_not_fit_one_p5_and_every_advised_change_fits():
    spec = job(model={"config": {"model_type": "llama"}, "tokenizer": "t", "activation_checkpointing": False},
               train={"micro_batch_size": 2, "steps": 100})
    p5 = catalog.lookup("p5.48xlarge")
    result = plan(spec, llama_70b(), Target(p5, 1, usd_per_hour=55.0, price_source="test"))
    assert not result.fits and result.advice and all(a.fits for a in result.advice)
    costs = [a.hours * a.usd_per_hour for a in result.advice]
    assert costs == sorted(costs)
    nodes = [a for a in result.advice if "nodes" in a.change]
    assert nodes and nodes[0].usd_per_hour > 55.0
    on_four = plan(spec, llama_70b(), Target(p5, 4, usd_per_hour=220.0))
    assert on_four.workload.workers == 32 and on_four.items["parameters"] == 4 * llama_70b().params / 32


def test_the_json_has_what_scripts_read():
    result = plan(job(), small_shape(), Target(catalog.lookup("g6.12xlarge"), 2, usd_per_hour=9.2, price_source="x"))
    data = result.to_dict()
    for key in ("fits", "per_gpu_gib", "gpu_gib", "tokens_per_s_per_gpu", "step_s", "hours", "usd_per_hour",
                "usd_total", "price_source", "advice"):
        assert key in data
    assert data["fits"] is True and data["workers"] == 8 and data["gpu_gib"] == pytest.approx(22.35, abs=0.01)
    # node start, image pull and weights staging are billed too: 5 + 6 min and the weights at 10 Gb/s
    assert data["start_s"]["node"] == 300 and data["start_s"]["image_pull"] == 360
    assert data["usd_total"] == pytest.approx((data["hours"] + sum(data["start_s"].values()) / 3600) * 9.2, rel=0.01)
    assert data["per_gpu_gib"]["total"] > data["per_gpu_gib"]["parameters"]


def test_a_job_asking_for_more_workers_than_the_target_has_gpus_is_refused():
    from trainlift.errors import SpecError

    with pytest.raises(SpecError, match="asks for 16 workers but 1x g6.12xlarge"):
        plan(job(scaling={"workers": 16}), small_shape(), Target(catalog.lookup("g6.12xlarge"), 1))


def test_a_measured_hfu_replaces_the_assumed_one(monkeypatch):
    data = dict(assumptions.assumptions())
    data["hfu"] = {**data["hfu"], "measured": {"H100": {"value": 0.5, "source": "benchmark 7", "label": "measured"}}}
    monkeypatch.setattr(assumptions, "assumptions", lambda: data)
    assert assumptions.hfu("H100") == (assumptions.Figure(0.5, "benchmark 7", "measured"), True)
    assert assumptions.hfu("L4")[0].value == 0.367 and assumptions.hfu("L4")[1] is False
