"""What a Ray Train worker imports before its first step, and what the driver imports before Ray Train starts.

A worker imports `trainlift.train.recipe` when it unpickles the train function (`raytrainer.RecipeTrainLoop`), after
Ray has imported torch and formed the process group: every module the recipe pulls in at import is paid there, by
every worker of every run, whether the run needs it or not. The heavy libraries below are imported by the functions
that use them instead. The test pins this by the modules present, not by seconds (timings on a shared machine vary
more than the whole budget; bench/first_step.py measures them).
"""

from __future__ import annotations

import json
import subprocess
import sys

# Not imported with the recipe, each with the reason (and where it is imported instead).
NOT_WITH_THE_RECIPE = {
    "transformers": "the model's class and config: build_model (weights.empty_model, build.sharded_config)",
    "safetensors": "the base model's files: weights.load_safetensors (keymap), only when model.path is given",
    "huggingface_hub": "transformers' hub client: a hub model is fetched by build.sharded_config, once per node",
    "accelerate": "imported by transformers' model loading, and with it boto3 (its SageMaker config)",
    "boto3": "imported by accelerate's SageMaker config; a worker's S3 goes through pyarrow",
    "peft": "LoRA's adapters: lora.apply, only with model.lora",
    "torch.distributed.checkpoint": "DCP: the safetensors reader (weights.load_safetensors), resume and saving",
    "torch.distributed.fsdp": "FSDP2's fully_shard: build.apply_fsdp",
    "torch.distributed.tensor": "DTensor: FSDP2 imports it when the model is sharded (build.apply_fsdp)",
    "sympy": "torch's symbolic shapes, imported by torch.distributed.tensor",
    "mlflow": "a tracker: trackers.py, only with run.trackers naming it",
    "tensorboard": "a tracker: trackers.py, only with run.trackers naming it",
    "matplotlib": "`trainlift report`'s plots, never on a worker",
    "datasets": "Hugging Face datasets: read by the driver when it builds the data cache",
}

PROBE = """
import json, sys
import trainlift.train.recipe
print(json.dumps(sorted(sys.modules)))
"""


def modules_after(code: str) -> set[str]:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def test_importing_the_recipe_leaves_the_heavy_libraries_to_the_functions_that_use_them():
    loaded = modules_after(PROBE)
    present = {name: NOT_WITH_THE_RECIPE[name] for name in NOT_WITH_THE_RECIPE if name in loaded}
    assert present == {}, present
    assert "torch" in loaded and "trainlift.train.recipe" in loaded  # the probe really imported the recipe


def test_the_recipe_still_reaches_what_it_imports_late():
    """The functions that import late find what they import (a renamed module would fail only inside a run)."""
    code = """
import json, sys
import torch
from trainlift.train.model import build, export, weights
config = build.build_config({"model_type": "llama", "hidden_size": 16, "intermediate_size": 32,
                             "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 32})
model = weights.empty_model(config)
reader = weights.headers_read_once(".")
print(json.dumps([type(model).__name__, type(reader).__mro__[1].__name__,
                  export.full_tensor(torch.ones(2)).tolist()]))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == ["LlamaForCausalLM", "HuggingFaceStorageReader",
                                                                [1.0, 1.0]]
