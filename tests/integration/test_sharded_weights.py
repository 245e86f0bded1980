"""Sharded load, random init and export across 2 gloo ranks (torch.distributed.run on CPU), compared with
transformers' own `from_pretrained` in this process. One 2-rank job serves every test in the module."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(REPO, "examples", "tiny", "tokenizer")
LAYERS = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 1, "max_position_embeddings": 64}
GENERATION = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "max_new_tokens": 17}


def save_model(path, model_type: str, tied: bool, dtype: torch.dtype) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from trainlift.train.model.build import build_config

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    torch.manual_seed(1)
    config = build_config({"model_type": model_type, "tie_word_embeddings": tied, **LAYERS}, tokenizer)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.generation_config = GenerationConfig(**GENERATION)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def from_pretrained(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    save_model(root / "qwen2-tied", "qwen2", tied=True, dtype=torch.float32)
    save_model(root / "llama-untied", "llama", tied=False, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, 282, (2, 24), generator=generator)
    labels = input_ids.clone()
    labels[:, :5] = -100
    position_ids = torch.cat([torch.arange(12), torch.arange(12)]).repeat(2, 1)
    batch = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
    out = root / "out"
    out.mkdir()
    torch.save(batch, out / "batch.pt")
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "src"), "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(REPO, "tests", "integration", "sharded_weights_job.py"),
           str(out), str(root / "qwen2-tied"), str(root / "llama-untied")]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    return {"root": root, "out": out, "batch": batch, "results": json.loads((out / "results.json").read_text())}


def assert_same_as_from_pretrained(loaded: dict, reference) -> None:
    expected = {**dict(reference.named_buffers()), **reference.state_dict()}
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def test_sharded_load_of_tied_qwen2_is_bit_identical_to_from_pretrained(job):
    loaded = torch.load(job["out"] / "tied_loaded.pt", weights_only=True)
    assert_same_as_from_pretrained(loaded, from_pretrained(job["root"] / "qwen2-tied"))
    assert torch.equal(loaded["lm_head.weight"], loaded["model.embed_tokens.weight"])
    assert job["results"]["tied_still_tied"] is True


def test_sharded_load_of_untied_bf16_llama_is_bit_identical_to_from_pretrained(job):
    """The files hold bf16; both paths upcast to fp32 the same way. Rotary inv_freq is recomputed after meta init."""
    loaded = torch.load(job["out"] / "untied_loaded.pt", weights_only=True)
    assert_same_as_from_pretrained(loaded, from_pretrained(job["root"] / "llama-untied"))
    assert not torch.equal(loaded["lm_head.weight"], loaded["model.embed_tokens.weight"])
    assert job["results"]["untied_still_tied"] is False


def test_random_init_from_config_is_the_same_on_two_ranks_as_on_one(job):
    """World size 1 here (no process group: the shard is the whole tensor) against world size 2 in the job."""
    from transformers import AutoTokenizer

    from trainlift.train.model import weights
    from trainlift.train.model.build import build_config

    sys.path.insert(0, os.path.join(REPO, "tests", "integration"))
    from sharded_weights_job import RANDOM_INIT_CONFIG

    model = weights.empty_model(build_config(RANDOM_INIT_CONFIG, AutoTokenizer.from_pretrained(TOKENIZER)))
    weights.materialize_shards(model, torch.device("cpu"))
    weights.init_random(model, seed=7)
    two_ranks = torch.load(job["out"] / "random_init.pt", weights_only=True)
    one_rank = {**dict(model.named_buffers()), **model.state_dict()}
    assert set(two_ranks) == set(one_rank)
    for name, tensor in one_rank.items():
        assert torch.equal(two_ranks[name], tensor), name
    # initialised the model's way: unit norms, small normal weights, not left empty
    assert torch.equal(one_rank["model.norm.weight"], torch.ones(32))
    std = one_rank["model.layers.0.mlp.up_proj.weight"].std().item()
    assert std == pytest.approx(model.config.initializer_range, rel=0.2)


def test_chunked_loss_on_sharded_model_matches_plain_loss_and_gradients(job):
    """Chunked (7 tokens per chunk, under FSDP on 2 ranks) vs the plain full-logits loss in one process.
    Tolerance: rtol 1e-5, atol 1e-6 (fp32; only the summation order differs)."""
    from trainlift.train.model.loss import plain_token_loss_sum

    model = from_pretrained(job["root"] / "llama-untied")
    batch = job["batch"]
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    loss = plain_token_loss_sum(logits, batch["labels"])
    loss.backward()
    sharded = torch.load(job["out"] / "loss_grads.pt", weights_only=True)
    torch.testing.assert_close(sharded["loss"], loss.detach(), rtol=1e-5, atol=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(sharded["grads"][name], param.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_export_without_gathering_is_loadable_sharded_and_equal_to_the_weights(job):
    from safetensors import safe_open

    export_dir = job["out"] / "export"
    index = json.loads((export_dir / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in export_dir.glob("*.safetensors"))
    assert len(files) > 1 and set(index["weight_map"].values()) == set(files)
    for name in files:
        with safe_open(str(export_dir / name), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
    exported = from_pretrained(export_dir)
    source = from_pretrained(job["root"] / "llama-untied")
    for name, tensor in source.state_dict().items():
        assert torch.equal(exported.state_dict()[name], tensor), name
    generation = json.loads((export_dir / "generation_config.json").read_text())
    assert {k: generation[k] for k in GENERATION} == GENERATION
    assert json.loads((export_dir / "config.json").read_text())["dtype"] == "float32"
    assert (export_dir / "tokenizer.json").is_file()


def test_only_rank_0_ever_holds_a_whole_weight_during_export(job):
    """The export gathers each weight's shards to rank 0 (not an all-gather): rank 1 sends its shards and is
    handed no whole tensor, and no DTensor is gathered whole on every rank."""
    from safetensors import safe_open

    rank0 = json.loads((job["out"] / "results.json").read_text())["export_rank0"]
    rank1 = json.loads((job["out"] / "export_rank1.json").read_text())
    exported = 0
    for path in (job["out"] / "export").glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            exported += sum(torch.Size(f.get_slice(key).get_shape()).numel() for key in f.keys())
    assert rank1 == {"whole": 0, "elements": 0, "all_gathers": 0}
    assert rank0["all_gathers"] == 0 and rank0["elements"] == exported and rank0["whole"] > 0
