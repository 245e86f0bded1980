"""DPO's reference log-probs: scored once per run from the model as it started, stored in the run directory and read
back by any later start, on any worker count. `w` is the recipe's `Worker`."""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from trainlift.errors import UsageError
from trainlift.train.data import examples as data
from trainlift.train.model import lora, objectives, preference_loss
from trainlift.train.run.device import all_reduce_sum, to_device
from trainlift.train.run.runlog import RunLog


def reference_logps(w, model, objective: objectives.Objective, splits: dict[str, data.Packed | None],
                    data_cache: dict | None, step: int, log: RunLog) -> dict[str, np.ndarray]:
    """DPO's reference: every example's log-prob under the model as the run started, per split. Read from the run
    directory where a start of this run stored it (with any worker count), else scored now, each worker a disjoint
    slice of the rows, summed so that every worker holds all of them, and stored by rank 0. LoRA scores with the
    adapters off (the base model); a full fine-tune past step 0 no longer has the model it started from."""
    references = {}
    for split, packed in splits.items():
        if packed is None:
            continue
        started, examples = time.perf_counter(), preference_loss.example_count(packed)
        key = ((data_cache or {}).get(split) or {}).get("key", "local")
        path = preference_loss.reference_path(w.run_path, split, key)
        stored = preference_loss.read_reference(w.fs, path, examples)
        scored = all_reduce_sum([float(stored is None)], w.device).item() > 0  # unless every worker read it
        if scored and step > 0 and w.spec.model.lora is None:
            raise UsageError(f"{path}: the reference log-probs of run {w.spec.run.name} are gone, and a full "
                             f"fine-tune at step {step} no longer has the model it started from",
                             hint="start the run over under another run.name")
        references[split] = score_reference(w, model, objective, packed, examples) if scored else stored
        if scored and w.rank == 0:
            preference_loss.write_reference(w.fs, path, references[split])
        log.sink.write({"event": "reference", "step": step, "split": split, "examples": examples, "scored": scored,
                        "seconds": time.perf_counter() - started, "time": time.time()})
    return references


def score_reference(w, model, objective: objectives.Objective, packed: data.Packed,
                    examples: int) -> np.ndarray:
    slices = data.worker_row_batches(len(packed.rows), w.rank, w.world, w.spec.train.micro_batch_size)
    batches = ((to_device(objective.collate([packed.rows[j] for j in rows] or [objectives.DUMMY_ROW], rows),
                          w.device),
                preference_loss.examples_of_rows(packed, rows)) for rows in slices)
    with lora.adapters_off(model) if w.spec.model.lora is not None else contextlib.nullcontext():
        return preference_loss.score_examples(model, batches, examples, w.device)


def without_dropout(model: torch.nn.Module) -> None:
    """Dropout off in the policy (`train.dpo.dropout: false`), as TRL's DPO trainer does by default: every
    `nn.Dropout` and every float dropout probability a module keeps for its functional dropout (attention's)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in vars(module).items():
            if isinstance(value, float) and ("dropout" in name or "pdrop" in name):
                setattr(module, name, 0.0)
