"""A sharded load on 2 gloo ranks gives the logits of transformers' own `from_pretrained`, family by family.
Gemma's scaled embedding keeps its scale in a non-persistent buffer on a module that also holds a parameter:
it is rebuilt from the model's own init code like every other buffer the files do not hold."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(REPO, "examples", "tiny", "tokenizer")
LAYERS = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 64}
# What a family needs besides LAYERS: MoE sizes (2 of 4 experts per token, every layer sparse), GPT-NeoX's partial
# rotary. Mixtral and Qwen3-MoE save their experts one by one, which the model fuses on load.
FAMILY_LAYERS = {
    "gpt_neox": {"rotary_pct": 0.5},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1},
}
FAMILIES = ["gemma", "gemma2", "gemma3_text", "gpt_neox", "llama", "mistral", "mixtral", "phi3", "qwen2", "qwen3",
            "qwen3_moe"]
FUSED = "qwen3_moe_fused"  # Qwen3-MoE saved as the model names its weights (experts fused), as an export writes it
TOLERANCE = 1e-5  # max abs difference of fp32 logits; only the order of reductions may differ


def save_model(path, model_type: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainlift.train.model.build import build_config

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(build_config({"model_type": model_type, **LAYERS, **FAMILY_LAYERS.get(model_type, {})},
                                                          tokenizer))
    model.save_pretrained(path)


def save_as_named_in_the_model(source, path) -> None:
    """The model of `source` in files keyed by its own state dict names (no conversion reversed)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    path.mkdir()
    (path / "config.json").write_text((source / "config.json").read_text())
    state = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).state_dict()
    save_file({key: tensor.contiguous() for key, tensor in state.items()}, str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    for family in FAMILIES:
        save_model(root / family, family)
    save_as_named_in_the_model(root / "qwen3_moe", root / FUSED)
    input_ids = torch.randint(0, 282, (2, 16), generator=torch.Generator().manual_seed(3))
    out = root / "out"
    out.mkdir()
    torch.save({"input_ids": input_ids}, out / "batch.pt")
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "src"), "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(REPO, "tests", "integration", "model_families_job.py"), str(out),
           *(str(root / family) for family in [*FAMILIES, FUSED])]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    return {"root": root, "out": out, "input_ids": input_ids}


@pytest.mark.parametrize("family", [*FAMILIES, FUSED])
def test_sharded_load_gives_the_logits_of_from_pretrained(job, family):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(job["root"] / family, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(input_ids=job["input_ids"], use_cache=False).logits
    sharded = torch.load(job["out"] / f"{family}.pt", weights_only=True)
    difference = (sharded - expected).abs().max().item()
    assert difference <= TOLERANCE, f"{family}: max abs logit difference {difference:.3g}"


def test_the_files_of_a_moe_hold_experts_one_by_one_that_the_model_fuses(job):
    """What the loader converts: save_pretrained reverses transformers' converters, so the files keep the legacy
    per-expert layout while the model holds one 3-D parameter per projection."""
    from safetensors import safe_open

    with safe_open(str(job["root"] / "mixtral" / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in keys
    assert not any("gate_up_proj" in key for key in keys)


@pytest.mark.parametrize(("fields", "refused"), [
    ({"model_type": "t5"}, r"^model: 't5' models have no causal LM class"),
    ({"model_type": "qwen3_moe", "quantization_config": {"quant_method": "fp8"}},
     r"^model.path: the checkpoint is fp8-quantized"),
])
def test_a_model_the_sharded_load_cannot_fill_is_refused_in_one_line(fields, refused):
    from trainlift.errors import UsageError
    from trainlift.train.model import families

    with pytest.raises(UsageError, match=refused) as caught:
        families.check_loadable(fields)
    assert "\n" not in caught.value.one_line() and caught.value.hint


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tested_family_passes_the_check(family):
    """The driver reads transformers' causal LM model types from its source (it imports no transformers): every
    tested family is among them, and so is the whole list transformers itself exposes."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from trainlift.train.model import families

    families.check_loadable({"model_type": family})
    assert families.causal_lm_types() == frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
