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
FAMILIES = ["gemma", "gemma2", "gemma3_text", "llama", "qwen2"]
TOLERANCE = 1e-5  # max abs difference of fp32 logits; only the order of reductions may differ


def save_model(path, model_type: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainlift.train.model.build import build_config

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(build_config({"model_type": model_type, **LAYERS}, tokenizer))
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    for family in FAMILIES:
        save_model(root / family, family)
    input_ids = torch.randint(0, 282, (2, 16), generator=torch.Generator().manual_seed(3))
    out = root / "out"
    out.mkdir()
    torch.save({"input_ids": input_ids}, out / "batch.pt")
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "src"), "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(REPO, "tests", "integration", "model_families_job.py"), str(out),
           *(str(root / family) for family in FAMILIES)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    return {"root": root, "out": out, "input_ids": input_ids}


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_load_gives_the_logits_of_from_pretrained(job, family):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(job["root"] / family, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(input_ids=job["input_ids"], use_cache=False).logits
    sharded = torch.load(job["out"] / f"{family}.pt", weights_only=True)
    difference = (sharded - expected).abs().max().item()
    assert difference <= TOLERANCE, f"{family}: max abs logit difference {difference:.3g}"
