"""What users combine, each cell checked for the invariants that hold in every one (tests/integration/
training_matrix_cells.py runs the cells through the recipe's own functions, on the shared local Ray cluster, CPU,
gloo): objective (SFT, DPO) × adapter (full, LoRA) × precision (fp32, and the GPU's mixed-precision policy of bf16
parameters with fp32 gradient reduction, run on the CPU) × mesh (FSDP on 2 ranks, HSDP 2×2 on 4).

× `train.compile`: every cell runs eager and compiled. Each cell starts with dynamo's caches cleared, so it traces
and compiles as a fresh run would; Inductor's on-disk cache serves the kernels an earlier cell or mesh built. A
compiled cell that hit dynamo's recompile limit would fall back to eager silently; the cells make that an error.
On 2 cores the whole matrix (both meshes, 32 cells) takes about 6 minutes with an empty Inductor cache.

In every cell:
- every trainable parameter has a finite, non-zero gradient at each of the 4 steps (LoRA's `lora_A` excepted
  at step 1 only, where its gradient is exactly zero: `lora_B` starts at zero, as peft initialises it);
- the checkpoint holds every trainable key (a tied LM head under both its names) and no frozen one;
- a resume from the step-2 checkpoint continues with the uninterrupted run's losses at steps 3 and 4 (relative
  1e-6: the resumed run computes the same thing; observed equal to the last bit);
- DPO: step 1's loss is log 2 (the policy is its reference; within 1e-6, and 1e-4 in bf16, where a compiled
  block runs other kernels with its adapters off than on), a LoRA run's reference scored again at the resume, with
  the trained adapters switched off, equals the first one, and the policy runs without dropout.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("ray_local")
REPO = Path(__file__).resolve().parents[2]
CELLS_MODULE = Path(__file__).with_name("training_matrix_cells.py")
LORA = ("model.lora.r=4", "model.lora.alpha=8", "model.lora.dropout=0.1", "model.lora.target_modules=all-linear")
EAGER = list(itertools.product(("sft", "dpo"), ("full", "lora"), ("fp32", "bf16"), (False,)))
COMPILED = list(itertools.product(("sft", "dpo"), ("full", "lora"), ("fp32", "bf16"), (True,)))
MESHES = {"fsdp2": (1, 2), "hsdp2x2": (2, 2)}
REL = 1e-6
# A worker's share of the shared Ray's 4 logical CPUs: the 4 workers of HSDP start beside whatever placement group an
# earlier test's controller has not yet given back.
WORKER_CPUS = 0.25


def overrides(cell: tuple, prefs: Path) -> list[str]:
    objective, adapter, precision, compiled = cell
    found = [f"train.objective={objective}", f"model.dtype={precision}", f"train.compile={str(compiled).lower()}"]
    if objective == "dpo":
        found += [f"data.train={prefs}", "data.format=preference"]
    return found + (list(LORA) if adapter == "lora" else [])


def cell_id(cell: tuple) -> str:
    objective, adapter, precision, compiled = cell
    return f"{objective}-{adapter}-{precision}" + ("-compiled" if compiled else "")


@pytest.fixture(scope="module")
def matrix(tiny_assets, tmp_path_factory):
    """Each mesh's cells, run by one Ray Train group: {mesh: {cell id: result}}."""
    import runpy

    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    root = tmp_path_factory.mktemp("matrix")
    prefs = root / "prefs.jsonl"
    prefs.write_text("".join((REPO / "examples" / "data" / "prefs-train.jsonl").read_text().splitlines(True)[:100]))
    base = {"model": {"path": str(tiny_assets / "model")},
            "data": {"train": str(tiny_assets / "train.jsonl"), "seq_len": 64},
            "train": {"steps": 4, "micro_batch_size": 2, "lr": 1e-3, "warmup_steps": 1, "seed": 0},
            "run": {"name": "matrix", "storage": str(root / "runs"), "max_failures": 0}}
    cells = EAGER + COMPILED
    results = {}
    for mesh, shape in MESHES.items():
        out = root / f"{mesh}.json"
        loop = runpy.run_path(str(CELLS_MODULE))["run_cells"]
        TorchTrainer(loop, train_loop_config={"base": base, "cells": [overrides(c, prefs) for c in cells],
                                              "mesh": list(shape), "root": str(root / mesh), "out": str(out)},
                     scaling_config=ScalingConfig(num_workers=shape[0] * shape[1],
                                                  resources_per_worker={"CPU": WORKER_CPUS})).fit()
        results[mesh] = dict(zip(map(cell_id, cells), json.loads(out.read_text())))
    return results


ALL = [(mesh, cell_id(c)) for mesh in MESHES for c in EAGER + COMPILED]


@pytest.mark.parametrize("mesh,cell", ALL, ids=[f"{m}-{c}" for m, c in ALL])
def test_every_trainable_parameter_gets_a_finite_non_zero_gradient_each_step(matrix, mesh, cell):
    result = matrix[mesh][cell]
    assert len(result["grads"]) == 4 and len(result["expected"]) > 0
    for step, report in enumerate(result["grads"], start=1):
        assert set(report) == set(result["expected"])
        wrong = {name: state for name, state in report.items()
                 if state != ("zero" if step == 1 and ".lora_A." in name else "ok")}
        assert not wrong, f"step {step}: {wrong}"


@pytest.mark.parametrize("mesh,cell", ALL, ids=[f"{m}-{c}" for m, c in ALL])
def test_the_checkpoint_holds_every_trainable_key_and_a_resume_continues_the_losses(matrix, mesh, cell):
    result = matrix[mesh][cell]
    assert result["checkpoint_keys"] == result["expected_checkpoint_keys"]
    uninterrupted, resumed = result["losses"][2:], result["resumed_losses"]
    assert len(resumed) == 2 and all(math.isfinite(x) for x in result["losses"])
    for a, b in zip(uninterrupted, resumed):
        assert abs(a - b) <= REL * abs(a), (uninterrupted, resumed)


@pytest.mark.parametrize("mesh,cell", [(m, c) for m, c in ALL if c.startswith("dpo")],
                         ids=[f"{m}-{c}" for m, c in ALL if c.startswith("dpo")])
def test_dpo_starts_at_its_reference_without_dropout(matrix, mesh, cell):
    result = matrix[mesh][cell]
    assert result["losses"][0] == pytest.approx(math.log(2), abs=1e-4 if "bf16" in cell else 1e-6)
    assert result["reference_drift"] == pytest.approx(0.0, abs=1e-6)
    assert result["dropout"] == 0.0


@pytest.mark.parametrize("mesh", MESHES)
def test_sft_lora_keeps_its_dropout(matrix, mesh):
    """DPO turns dropout off; the SFT objective keeps the adapters' dropout as configured."""
    assert matrix[mesh]["sft-lora-fp32"]["dropout"] == pytest.approx(0.1)
