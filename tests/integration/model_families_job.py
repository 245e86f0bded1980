"""Run by test_model_families.py under `torch.distributed.run` (gloo, CPU): loads each model the way the recipe
does (meta device -> fully_shard -> fill from its safetensors files) and writes rank 0's logits on a fixed batch.

Usage: model_families_job.py OUT_DIR MODEL_DIR...
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from trainlift.config.job import ModelSection
from trainlift.train.model import weights
from trainlift.train.model.build import apply_fsdp, fill_weights, sharded_config


@torch.no_grad()
def sharded_logits(model_dir: str, batch: dict) -> torch.Tensor:
    spec = ModelSection(path=model_dir)
    model = apply_fsdp(weights.empty_model(sharded_config(spec)), torch.device("cpu"), bf16=False,
                       activation_checkpointing=False)
    fill_weights(model, spec, seed=0, device=torch.device("cpu"))
    model.eval()
    return model(**batch, use_cache=False).logits


def main(out_dir: str, *model_dirs: str) -> None:
    dist.init_process_group("gloo")
    out = Path(out_dir)
    batch = torch.load(out / "batch.pt", weights_only=True)
    for model_dir in model_dirs:
        logits = sharded_logits(model_dir, batch)
        if dist.get_rank() == 0:
            torch.save(logits, out / f"{Path(model_dir).name}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
