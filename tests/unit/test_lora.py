"""LoRA: the spec section, target validation on a weightless model, and the per-tensor merge (peft as reference)."""

import math

import pytest
import torch

from trainlift.config.job import validate_job_spec
from trainlift.errors import SpecError
from trainlift.train.model import lora

TINY = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 96, "tie_word_embeddings": True}


def spec(**model):
    return validate_job_spec({"model": {"path": "m", **model}, "data": {"train": "t.jsonl"}})


def qwen2(device="cpu"):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY))


def test_lora_is_off_by_default_and_merge_on():
    job = spec()
    assert job.model.lora is None and job.export.merge is True
    section = spec(lora={}).model.lora
    assert section.r == 16 and section.scaling_alpha == 32 and section.target_modules == "all-linear"
    assert spec(lora={"r": 4, "alpha": 8}).model.lora.scaling_alpha == 8


@pytest.mark.parametrize("lora_section,message", [
    ({"r": 0}, r"model.lora.r: .*greater than 0 \(got 0\)"),
    ({"rank": 8}, r"model.lora.rank: unknown key"),
    ({"target_modules": []}, r"model.lora.target_modules: name at least one module"),
    ({"dropout": 1.0}, r"model.lora.dropout: .*less than 1"),
    ({"target_modules": "all"}, r"model.lora.target_modules"),
])
def test_bad_lora_sections_name_the_field(lora_section, message):
    with pytest.raises(SpecError, match=message):
        spec(lora=lora_section)


def test_export_section_rejects_unknown_keys():
    with pytest.raises(SpecError, match=r"export.merged: unknown key"):
        validate_job_spec({"model": {"path": "m"}, "data": {"train": "t"}, "export": {"merged": False}})


def test_unknown_target_module_names_the_modules_that_exist():
    section = spec(lora={"target_modules": ["q_proj", "qkv_proj"]}).model.lora
    with pytest.raises(SpecError, match=r"'qkv_proj' matches no module of Qwen2ForCausalLM \(its linear layers: "
                                        r"down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj\)"):
        lora.check_targets(qwen2("meta"), section)


def test_a_target_that_is_not_a_linear_layer_is_refused():
    section = spec(lora={"target_modules": ["mlp"]}).model.lora
    with pytest.raises(SpecError, match=r"'mlp' is a Qwen2MLP in Qwen2ForCausalLM, not a linear layer"):
        lora.check_targets(qwen2("meta"), section)


def test_validate_accepts_a_supported_model():
    from transformers import AutoConfig

    lora.validate(AutoConfig.for_model(**TINY), spec(lora={"target_modules": ["q_proj", "v_proj"]}).model.lora)
    lora.validate(AutoConfig.for_model(**TINY), spec(lora={}).model.lora)


def test_an_architecture_peft_cannot_adapt_is_one_spec_error():
    """peft 0.21 refuses all-linear LoRA on Mamba-style models (their out_proj/conv1d are incompatible)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("falcon_mamba", hidden_size=32, num_hidden_layers=2, vocab_size=96, state_size=4)
    with pytest.raises(SpecError, match=r"model.lora: peft cannot add LoRA adapters to FalconMambaForCausalLM") as err:
        lora.validate(config, spec(lora={}).model.lora)
    assert "\n" not in err.value.one_line()


def test_parameter_counts_split_adapters_from_the_frozen_base():
    base = qwen2()
    base_total = sum(p.numel() for p in base.parameters())
    model = lora.apply(base, spec(lora={"r": 4, "target_modules": ["q_proj", "v_proj"]}).model.lora)
    counts = lora.parameter_counts(model)
    adapters = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    # q_proj: 32 -> 32, v_proj: 32 -> 16 (one KV head of 16), 2 layers, rank 4: A is r x in, B is out x r.
    assert adapters == 2 * (4 * 32 + 32 * 4 + 4 * 32 + 16 * 4)
    assert counts == {"trainable_params": adapters, "total_params": base_total + adapters}
    assert lora.flops_per_token(1e6, model) < 1e6


def test_merged_weights_equal_peft_merge_and_unload():
    """The per-tensor merge that final/ is written from gives peft's own merged model, under the base model's
    names, the tied LM head once (tol 1e-6, fp32)."""
    section = spec(lora={"r": 4, "alpha": 12}).model.lora
    model = lora.apply(qwen2(), section)
    with torch.no_grad():  # non-zero B, as after training (peft starts B at zero)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    sources = lora.merged_weights(model)
    merged = {name: source.full() for name, source in sources.items()}
    assert all(tuple(merged[name].shape) == source.shape for name, source in sources.items())
    reference = model.merge_and_unload().state_dict()
    assert merged.keys() == reference.keys() - {"lm_head.weight"}
    for key, tensor in merged.items():
        torch.testing.assert_close(tensor, reference[key], rtol=1e-6, atol=1e-6, msg=key)
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           state["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"])


def test_checkpoint_key_names_base_weights_as_the_hf_files_do_and_skips_adapters():
    model = lora.apply(qwen2("meta"), spec(lora={"r": 4, "target_modules": ["q_proj"]}).model.lora)
    hf_names = set(qwen2("meta").state_dict())
    mapped = {name: lora.checkpoint_key(name) for name in model.state_dict()}
    assert {key for key in mapped.values() if key is not None} == hf_names
    assert sorted(name for name, key in mapped.items() if key is None) == [
        f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{ab}.default.weight" for i in (0, 1) for ab in "AB"]


def test_adapters_on_a_meta_model_are_initialised_as_peft_does_from_the_seed(monkeypatch):
    """peft on the meta device, then storage and `init_adapters`: A Kaiming-uniform within peft's bound
    (1/sqrt(fan_in) for a=sqrt(5)), B zero; the same seed gives the same A, and the global RNG is untouched."""
    section = spec(lora={"r": 4, "target_modules": ["q_proj", "v_proj"]}).model.lora

    def initialised(seed):
        model = lora.apply(qwen2("meta"), section).to_empty(device="cpu")
        rng = torch.get_rng_state()
        with monkeypatch.context() as patched:  # torch.manual_seed would reseed every GPU's generator too
            patched.setattr(torch, "manual_seed", lambda seed: pytest.fail("a GPU generator was reseeded"))
            lora.init_adapters(model, seed)
        assert torch.equal(torch.get_rng_state(), rng)
        return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}

    first, again, other = initialised(0), initialised(0), initialised(1)
    assert len(first) == 8 and first.keys() == again.keys()
    for name, tensor in first.items():
        assert torch.equal(tensor, again[name]), name
        if "lora_B" in name:
            assert not tensor.any(), name
        else:
            assert 0 < tensor.abs().max() <= 1 / math.sqrt(32), name
            assert not torch.equal(tensor, other[name]), name


def test_random_init_of_an_adapted_model_draws_the_base_weights_as_without_adapters(monkeypatch):
    """model.config with model.lora: `weights.init_random` skips the adapter modules, so the base weights are the
    ones the same seed gives without LoRA."""
    from trainlift.train.model import weights

    plain = qwen2("meta").to_empty(device="cpu")
    rng = torch.get_rng_state()
    with monkeypatch.context() as patched:
        patched.setattr(torch, "manual_seed", lambda seed: pytest.fail("a GPU generator was reseeded"))
        weights.init_random(plain, 7)
    assert torch.equal(torch.get_rng_state(), rng)
    adapted = lora.apply(qwen2("meta"), spec(lora={"r": 4}).model.lora).to_empty(device="cpu")
    weights.init_random(adapted, 7, lora.checkpoint_key)
    expected = plain.state_dict()
    compared = 0
    for name, tensor in adapted.state_dict().items():
        key = lora.checkpoint_key(name)
        if key is not None:
            assert torch.equal(tensor, expected[key]), name
            compared += 1
    assert compared == len(expected)


def test_frozen_base_can_be_stored_in_bf16_while_adapters_stay_fp32():
    model = lora.apply(qwen2(), spec(lora={"r": 4}).model.lora)
    lora.store_frozen_as(model, torch.bfloat16)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
