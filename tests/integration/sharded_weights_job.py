"""Run by test_sharded_weights.py under `torch.distributed.run` (gloo, CPU): builds models the way the recipe
does (meta device -> fully_shard -> fill), then writes what rank 0 sees for the test to compare.

Usage: sharded_weights_job.py OUT_DIR TIED_MODEL_DIR UNTIED_MODEL_DIR
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pyarrow.fs as pafs
import torch
import torch.distributed as dist

from trainlift.config.job import ModelSection
from trainlift.train.model import export, weights
from trainlift.train.model.loss import token_loss_sum
from trainlift.train.model.build import apply_fsdp, fill_weights, sharded_config

LOSS_CHUNK_ELEMENTS = 2048  # 7 tokens per chunk at the tiny tokenizer's 282-token vocabulary: several per row
RANDOM_INIT_CONFIG = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                      "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}


def sharded(model_spec: ModelSection, seed: int = 0) -> torch.nn.Module:
    model = weights.empty_model(sharded_config(model_spec))
    model = apply_fsdp(model, torch.device("cpu"), bf16=False, activation_checkpointing=False)
    return fill_weights(model, model_spec, seed, torch.device("cpu"))


def gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    tensors = {name: export.full_tensor(t) for name, t in model.state_dict().items()}
    for name, buffer in model.named_buffers():
        tensors.setdefault(name, buffer.detach().cpu().clone())  # non-persistent ones (rotary inv_freq) too
    return tensors


@contextlib.contextmanager
def whole_tensors_seen():
    """During an export: how many whole weights `export.full_tensor` handed this rank (and their elements), and
    whether anything asked for a DTensor's full tensor on every rank (an all-gather)."""
    from torch.distributed.tensor import DTensor

    seen = {"whole": 0, "elements": 0, "all_gathers": 0}
    original_full, original_all_gather = export.full_tensor, DTensor.full_tensor

    def counted_full(tensor):
        whole = original_full(tensor)
        if whole is not None:
            seen["whole"] += 1
            seen["elements"] += whole.numel()
        return whole

    def counted_all_gather(self, *args, **kwargs):
        seen["all_gathers"] += 1
        return original_all_gather(self, *args, **kwargs)

    export.full_tensor, DTensor.full_tensor = counted_full, counted_all_gather
    try:
        yield seen
    finally:
        export.full_tensor, DTensor.full_tensor = original_full, original_all_gather


def main(out_dir: str, tied_dir: str, untied_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(out_dir)
    results: dict = {"world": dist.get_world_size()}

    for label, path in (("tied", tied_dir), ("untied", untied_dir)):
        model = sharded(ModelSection(path=path))
        results[f"{label}_still_tied"] = model.lm_head.weight is model.model.embed_tokens.weight
        state = gathered(model)
        if rank == 0:
            torch.save(state, out / f"{label}_loaded.pt")

    model = sharded(ModelSection(config=RANDOM_INIT_CONFIG, tokenizer=tied_dir), seed=7)
    state = gathered(model)
    if rank == 0:
        torch.save(state, out / "random_init.pt")

    model = sharded(ModelSection(path=untied_dir))
    batch = torch.load(out / "batch.pt", weights_only=True)
    loss = token_loss_sum(model, batch, chunk_elements=LOSS_CHUNK_ELEMENTS)
    loss.backward()
    grads = {name: export.full_tensor(p.grad) for name, p in model.named_parameters()}
    if rank == 0:
        torch.save({"loss": loss.detach(), "grads": grads}, out / "loss_grads.pt")

    model = sharded(ModelSection(path=untied_dir))
    from transformers import AutoConfig, AutoTokenizer

    fs = pafs.LocalFileSystem()
    with whole_tensors_seen() as seen:
        export.export_hf(fs, str(out / "export"), model, AutoConfig.from_pretrained(untied_dir),
                         AutoTokenizer.from_pretrained(untied_dir), torch.float32, source_dir=untied_dir,
                         max_file_bytes=64 * 1024)
    results[f"export_rank{rank}"] = seen
    if rank == 1:
        (out / "export_rank1.json").write_text(json.dumps(seen))
    dist.barrier()
    if rank == 0:
        (out / "results.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
