"""The cells of the training matrix (tests/integration/test_training_matrix.py), run on every rank of one process
group: each cell is one combination of objective, adapter, precision and `train.compile` on the group's mesh, run
through the recipe's own functions (build_model, build_optimizer, the DPO reference pass, queue_step, the checkpoint
writer and loader). Not a test module.

A cell trains `STEPS` steps, checkpointing after `CHECKPOINT_AT`, then builds the model again, resumes from that
checkpoint (scoring a LoRA run's reference again, with its trained adapters switched off, as a resumed run does when
the stored reference is gone) and trains to `STEPS` again. It records, per step, which trainable parameters got a
gradient that is there, finite and non-zero; the trainable keys the checkpoint holds; both runs' losses; and the
largest dropout probability left in the model."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import torch
import torch.distributed as dist

from trainlift.config.job import apply_overrides, validate_job_spec
from trainlift.train.data import examples as data, preference
from trainlift.train.model import objectives, preference_loss, weights
from trainlift.train.model.build import load_tokenizer
from trainlift.train.recipe import Worker, build_model, build_optimizer, queue_step, read_step, step_batches
from trainlift.train.run import checkpoint
from trainlift.train.run.mesh import Mesh
from trainlift.train.run.reference import score_reference

STEPS, CHECKPOINT_AT = 4, 2
LORA = ("model.lora.r=4", "model.lora.alpha=8", "model.lora.dropout=0.1", "model.lora.target_modules=all-linear")


def cell_overrides(objective: str, adapter: str, precision: str, compiled: bool) -> list[str]:
    overrides = [f"train.objective={objective}", f"model.dtype={precision}", f"train.compile={str(compiled).lower()}"]
    return overrides + (list(LORA) if adapter == "lora" else [])


def expected_trainable(model, adapter: str) -> set[str]:
    """What a cell must train, from the parameter names alone: LoRA's adapters, or every weight."""
    names = {name for name, _ in model.named_parameters()}
    return {n for n in names if ".lora_" in n} if adapter == "lora" else names


def expected_checkpoint_keys(model, trained: set[str]) -> set[str]:
    """The trained weights, under every name a tied one has (a tied LM head is saved under both)."""
    return trained | {alias for alias, name in weights.tied_aliases(model).items() if name in trained}


def gradient_report(model, expected: set[str]) -> dict[str, str]:
    """Per expected parameter: "ok", or what is wrong with its gradient (gathered whole: every rank alike)."""
    found = {}
    for name, param in model.named_parameters():
        if name not in expected:
            continue
        grad = param.grad
        # Every rank must take part in full_tensor alike; a rank without the gradient joins with zeros.
        local = grad if grad is not None else torch.zeros_like(param)
        whole = local.full_tensor() if hasattr(local, "full_tensor") else local
        present = torch.tensor([float(grad is not None)])
        dist.all_reduce(present, op=dist.ReduceOp.MIN)
        if not present.item():
            found[name] = "none"
        elif not torch.isfinite(whole).all():
            found[name] = "not finite"
        elif not whole.abs().sum() > 0:
            found[name] = "zero"
        else:
            found[name] = "ok"
    return found


def checkpoint_keys(path: str) -> set[str]:
    from trainlift.train.run.safe_load import parse_metadata

    metadata = parse_metadata(Path(path, ".metadata").read_bytes(), path)
    return {key.removeprefix("model.") for key in metadata.state_dict_metadata if key.startswith("model.")}


def splits_for(spec, tokenizer):
    if spec.train.objective == "dpo":
        return preference.prepare(spec.data.train, tokenizer, spec.data.seq_len)
    return data.prepare(spec.data.train, spec.data.format, tokenizer, spec.data.seq_len)


def with_reference(w: Worker, model, packed) -> objectives.Objective:
    objective = objectives.loss_for(w.spec)
    if not objective.pairs:
        return objective
    reference = score_reference(w, model, objective, packed, preference_loss.example_count(packed))
    return replace(objective, references={"train": reference})


def train_steps(w: Worker, model, optimizer, scheduler, packed, objective, step: int, cursor: int,
                expected: set[str], grads: list | None) -> tuple[list[float], int]:
    """Steps from `step` to `STEPS`; per step its loss, and, when `grads` is a list, the gradient report taken just
    before the optimizer consumes the gradients, and the checkpoint at `CHECKPOINT_AT`."""
    losses, world = [], w.world
    hook = None
    if grads is not None:
        hook = optimizer.register_step_pre_hook(lambda *_: grads.append(gradient_report(model, expected)))
    rows_per_step = world * w.spec.train.micro_batch_size * w.spec.train.grad_accum
    try:
        while step < STEPS:
            batches = step_batches(packed, w.spec, cursor, w.rank, world, w.device, objective)
            figures = queue_step(model, optimizer, scheduler, batches, w.spec.train.max_grad_norm, world, w.device,
                                 objective=objective)
            losses.append(read_step(figures, objective.metrics).loss)
            step, cursor = step + 1, cursor + rows_per_step
            if step == CHECKPOINT_AT and grads is not None:
                checkpoint.write_shard(f"{w.run_path}/{checkpoint.dir_name(step)}", model, optimizer, scheduler, step, cursor, w.rank, world)
                dist.barrier()
    finally:
        if hook is not None:
            hook.remove()
    return losses, cursor


def run_cell(base: dict, overrides: list[str], run_dir: str, mesh: tuple[int, int], rank: int, world: int) -> dict:
    spec = validate_job_spec(apply_overrides(json.loads(json.dumps(base)), overrides))
    w = Worker(spec, rank, world, torch.device("cpu"), spec.model.dtype == "bf16", pafs.LocalFileSystem(), run_dir,
               Mesh(*mesh))
    adapter = "lora" if spec.model.lora else "full"
    packed = splits_for(spec, load_tokenizer(spec.model))

    model, _, _ = build_model(w)  # in the recipe's order: model, optimizer, resume, reference, steps
    expected = expected_trainable(model, adapter)
    dropout = max((m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)), default=0.0)
    optimizer, scheduler = build_optimizer(model, w)
    objective = with_reference(w, model, packed)
    grads: list[dict[str, str]] = []
    losses, _ = train_steps(w, model, optimizer, scheduler, packed, objective, 0, 0, expected, grads)
    saved = f"{run_dir}/{checkpoint.dir_name(CHECKPOINT_AT)}"
    keys = checkpoint_keys(saved)

    model, _, _ = build_model(w, resume_from=saved)
    optimizer, scheduler = build_optimizer(model, w)
    step, cursor = checkpoint.load(pafs.LocalFileSystem(), saved, model, optimizer, scheduler, rank)
    resumed_objective = with_reference(w, model, packed) if adapter == "lora" else objective
    resumed, _ = train_steps(w, model, optimizer, scheduler, packed, resumed_objective, step, cursor, expected, None)
    reference_drift = None
    if objective.references is not None:
        reference_drift = float(np.abs(objective.references["train"] - resumed_objective.references["train"]).max())
    return {"overrides": overrides, "grads": grads, "expected": sorted(expected), "checkpoint_keys": sorted(keys),
            "expected_checkpoint_keys": sorted(expected_checkpoint_keys(model, expected)),
            "losses": losses, "resumed_losses": resumed, "reference_drift": reference_drift, "dropout": dropout}


def run_cells(config: dict) -> None:
    """Ray Train's loop: every cell of `config["cells"]` on this group, results written by rank 0."""
    import ray.train

    import torch._dynamo as dynamo  # imported here: Ray pickles this function, and dynamo's config does not pickle

    dynamo.config.fail_on_recompile_limit_hit = True  # not a silent fall back to eager in a compiled cell
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    results = []
    for i, cell in enumerate(config["cells"]):
        dynamo.reset()  # each cell compiles as a fresh run would (Inductor's on-disk cache still serves)
        started = time.perf_counter()
        results.append(run_cell(config["base"], cell, f"{config['root']}/cell{i}", tuple(config["mesh"]), rank, world))
        results[-1]["seconds"] = time.perf_counter() - started
    if rank == 0:
        Path(config["out"]).write_text(json.dumps(results))
