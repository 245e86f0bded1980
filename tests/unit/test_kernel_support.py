"""The attention kernel fits the model and the dtype: auto picks the best kernel the model's class declares
(transformers' `_supports_flash_attn`, `_supports_flex_attn`, `_supports_sdpa`) and the compute dtype allows
(flash-attn takes fp16 and bf16 only); an explicit kernel they cannot run is refused on the driver, before Ray
starts, in one line that names the kernels that would work.

Gemma 2 declares no sdpa (its attention soft-capping has no sdpa path): before, auto gave it sdpa on a CPU, and
transformers refused it on the workers after Ray had started."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig

from trainlift.errors import UsageError
from trainlift.train.model import build, kernels

REPO = Path(__file__).resolve().parents[2]
H100 = SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, shared_memory_per_block_optin=232_448)
L4 = SimpleNamespace(name="NVIDIA L4", major=8, minor=9, shared_memory_per_block_optin=101_376)
GEMMA2 = {"model_type": "gemma2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 96,
          "max_position_embeddings": 128}


def gemma2_config():
    return AutoConfig.for_model(**GEMMA2)


def test_auto_on_a_cpu_gives_gemma2_a_kernel_it_declares():
    assert build.attention_implementation("auto", torch.device("cpu"), gemma2_config()) == "eager"
    assert build.attention_implementation("auto", torch.device("cpu"), AutoConfig.for_model("llama")) == "sdpa"
    gemma2 = build.model_kernels(gemma2_config())
    assert kernels.choose("auto", None, (False, ""), gemma2).line() == (
        "eager (a CPU, and Gemma2ForCausalLM does not support sdpa)")


def test_the_recipe_builds_gemma2_with_auto_on_a_cpu_and_trains_it(single_process_group, tmp_path):
    from trainlift.config.job import validate_job_spec
    from trainlift.train.model.loss import token_loss_sum
    from trainlift.train.recipe import Worker, build_model

    spec = validate_job_spec({"model": {"config": GEMMA2, "tokenizer": str(REPO / "examples" / "tiny" / "tokenizer")},
                              "data": {"train": str(tmp_path / "train.jsonl"), "seq_len": 64},
                              "scaling": {"workers": 1}, "run": {"name": "run", "storage": str(tmp_path)}})
    model, _, _ = build_model(Worker(spec, 0, 1, torch.device("cpu"), bf16=False, fs=None, run_path=""))
    assert model.config._attn_implementation == "eager"
    ids = torch.randint(0, GEMMA2["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(0))
    loss = token_loss_sum(model, {"input_ids": ids, "labels": ids, "position_ids": torch.arange(16)[None]})
    loss.backward()
    assert torch.isfinite(loss)


def test_auto_on_a_gpu_takes_the_best_kernel_the_model_declares():
    gemma2 = build.model_kernels(gemma2_config())
    assert kernels.choose("auto", H100, (True, ""), gemma2).kernel == "flash_attention_2"
    assert kernels.choose("auto", H100, (False, "flash-attn is not installed"), gemma2).kernel == "flex_attention"
    assert kernels.choose("auto", L4, (False, "flash-attn is not installed"), gemma2).line() == (
        "eager (flash-attn is not installed; flex's backward needs 131,074 bytes of shared memory a block and "
        "NVIDIA L4 has 101,376 (pytorch#133254); Gemma2ForCausalLM does not support sdpa)")


def test_fp32_compute_on_an_sm90_gpu_where_flash_attn_loads_is_not_given_flash():
    fp32 = kernels.ModelKernels(half_precision=False)
    choice = kernels.choose("auto", H100, (True, ""), fp32)
    assert choice.kernel == "flex_attention"
    assert choice.reason.startswith("flash_attention_2 runs in fp16 or bf16 only and model.dtype is fp32")
    assert kernels.choose("auto", H100, (True, ""), kernels.ModelKernels(half_precision=True)).kernel == \
        "flash_attention_2"


@pytest.mark.parametrize(("choice", "dtype", "refused"), [
    ("sdpa", "auto", "model.attn_implementation: Gemma2ForCausalLM does not support sdpa; kernels that would work: "
                     "flash_attention_2, flex_attention, eager"),
    ("flash_attention_2", "fp32", "model.attn_implementation: flash_attention_2 runs in fp16 or bf16 only and "
                                  "model.dtype is fp32; kernels that would work: flex_attention, eager"),
])
def test_an_impossible_explicit_kernel_is_refused_by_the_driver_check(tmp_path, choice, dtype, refused):
    from trainlift.config.job import validate_job_spec
    from trainlift.train.run import preflight

    data = tmp_path / "train.jsonl"
    data.write_text("".join((REPO / "examples" / "data" / "tasks-train.jsonl").read_text().splitlines(True)[:8]))
    spec = validate_job_spec({
        "model": {"config": GEMMA2, "tokenizer": str(REPO / "examples" / "tiny" / "tokenizer"),
                  "attn_implementation": choice, "dtype": dtype},
        "data": {"train": str(data), "seq_len": 64}, "scaling": {"workers": 1},
        "run": {"name": "run", "storage": str(tmp_path / "runs")}})
    with pytest.raises(UsageError) as caught:
        preflight.check(spec)
    assert caught.value.message == refused and caught.value.exit_code == 2
    assert "\n" not in caught.value.one_line()
    ok = validate_job_spec({**spec.model_dump(mode="json"),
                            "model": {**spec.model.model_dump(mode="json"), "attn_implementation": "eager"}})
    preflight.check(ok)


def test_the_workers_refuse_it_too_from_the_class_itself():
    with pytest.raises(UsageError, match=r"Gemma2ForCausalLM does not support sdpa; kernels that would work: "):
        build.attention_implementation("sdpa", torch.device("cpu"), gemma2_config())
    with pytest.raises(UsageError, match=r"flash_attention_2 runs in fp16 or bf16 only"):
        build.attention_implementation("flash_attention_2", torch.device("cuda"), AutoConfig.for_model("llama"),
                                       bf16=False)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3_moe", "gemma2", "mixtral", "gpt2", "gpt_neox",
                                        "phi", "falcon", "opt", "bloom", "mpt", "exaone"])
def test_the_flags_read_from_source_are_the_classes_own(model_type):
    """The driver reads the flags from transformers' source (exaone: a model type that reuses LlamaForCausalLM);
    the workers read them from the class transformers builds."""
    assert kernels.declared_kernels(model_type) == build.model_kernels(AutoConfig.for_model(model_type))


def test_the_driver_check_imports_neither_torch_nor_transformers():
    probe = ("import json, sys; from trainlift.train.model import kernels; "
             "kernels.check_spec_choice('eager', 'auto', {'model_type': 'gemma2'}); "
             "print(json.dumps([kernels.declared_kernels('gemma2').usable(), "
             "[m for m in ('torch', 'transformers') if m in sys.modules]]))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(done.stdout) == [["flash_attention_2", "flex_attention", "eager"], []]
