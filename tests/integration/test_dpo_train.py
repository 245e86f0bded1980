"""DPO through the real recipe on the shared local Ray cluster of the test run (CPU, gloo, FSDP2), on the synthetic
preference pairs of examples/data/prefs-*.jsonl (the chosen reply is the answer alone, the rejected one wraps it
in filler) with the tiny Qwen2 model.

Three runs: a full fine-tune on 2 workers (checkpoints every 5 steps), LoRA on 2 workers logging to TensorBoard
and MLflow, and the full fine-tune's step-5 checkpoint and reference log-probs resumed on 1 worker."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from trainlift.train.launch import run_training

pytestmark = pytest.mark.usefixtures("ray_local")
REPO = Path(__file__).resolve().parents[2]
STEPS, CHECKPOINT_AT = 12, 5
LORA = ("model.lora.r=4", "model.lora.alpha=8", "model.lora.target_modules=all-linear", "train.lr=1e-2")
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy")


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows_of(run_dir) if "loss" in r}


def reference_events(run_dir: Path) -> list[tuple[str, bool]]:
    return [(r["split"], r["scored"]) for r in rows_of(run_dir) if r.get("event") == "reference"]


@pytest.fixture(scope="module")
def dpo_spec(tiny_assets, tmp_path_factory):
    """`dpo_spec(storage, *overrides)`: a DPO job on 400 train and 60 eval pairs, 12 steps of 2 rows per worker."""
    from trainlift.config.job import apply_overrides, validate_job_spec

    data = tmp_path_factory.mktemp("prefs")
    for split, n in (("train", 400), ("eval", 60)):
        lines = (REPO / "examples" / "data" / f"prefs-{split}.jsonl").read_text().splitlines(True)[:n]
        (data / f"{split}.jsonl").write_text("".join(lines))

    def make(storage, *overrides: str):
        raw = {"model": {"path": str(tiny_assets / "model")},
               "data": {"train": str(data / "train.jsonl"), "eval": str(data / "eval.jsonl"), "seq_len": 128},
               "train": {"objective": "dpo", "steps": STEPS, "micro_batch_size": 2, "lr": 1e-3, "warmup_steps": 1,
                         "seed": 0},
               "scaling": {"workers": 2},
               "checkpoint": {"every_steps": CHECKPOINT_AT, "keep": 3},
               "run": {"name": "dpo", "storage": str(storage), "max_failures": 0}}
        return validate_job_spec(apply_overrides(raw, overrides))

    return make


@pytest.fixture(scope="module")
def full_run(dpo_spec, tmp_path_factory):
    storage = tmp_path_factory.mktemp("dpo-full")
    return run_training(dpo_spec(storage, "run.name=full")), storage / "full"


@pytest.fixture(scope="module")
def lora_run(dpo_spec, tmp_path_factory):
    storage = tmp_path_factory.mktemp("dpo-lora")
    mlflow_uri = f"file://{storage / 'mlruns'}"
    previous = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # MLflow's file store is opt-in; the workers get it forwarded
    try:
        summary = run_training(dpo_spec(storage, *LORA, "run.name=lora", "run.trackers=[tensorboard,mlflow]",
                                        f"run.mlflow_uri={mlflow_uri}"))
    finally:
        if previous is None:
            os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
        else:
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = previous
    return summary, storage / "lora", mlflow_uri


def test_full_fine_tune_learns_the_preference_and_logs_its_rewards(full_run):
    """Eval reward accuracy from 0 (policy = reference at step 0) to above 0.8; the step loss starts at log 2;
    every step row carries the four rewards; the reference log-probs are scored once per split and stored."""
    summary, run_dir = full_run
    assert summary["finished"] and summary["steps"] == STEPS and summary["objective"] == "dpo"
    assert summary["initial_eval_loss"] == pytest.approx(np.log(2), rel=1e-6)
    assert summary["eval_rewards/accuracy"] > 0.8 and summary["eval_loss"] < summary["initial_eval_loss"]
    steps = [r for r in rows_of(run_dir) if "loss" in r]
    assert steps[0]["loss"] == pytest.approx(np.log(2), rel=1e-5) and set(REWARDS) <= steps[0].keys()
    assert steps[-1]["rewards/margin"] > 0 and steps[-1]["rewards/chosen"] > steps[-1]["rewards/rejected"]
    evals = [r for r in rows_of(run_dir) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, STEPS] and evals[0]["eval_rewards/accuracy"] == 0.0
    assert reference_events(run_dir) == [("train", True), ("eval", True)]
    stored = sorted(p.name for p in (run_dir / "reference").iterdir())
    assert len(stored) == 2 and stored[0].startswith("eval-") and stored[1].startswith("train-")
    assert (run_dir / "final" / "model.safetensors").exists()


def test_lora_learns_the_preference_and_its_rewards_reach_tensorboard_and_mlflow(lora_run):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing import event_accumulator

    summary, run_dir, mlflow_uri = lora_run
    assert summary["finished"] and summary["trainable_params"] < summary["total_params"]
    assert summary["eval_rewards/accuracy"] > 0.8
    assert reference_events(run_dir) == [("train", True), ("eval", True)]
    accumulator = event_accumulator.EventAccumulator(str(run_dir / "tensorboard"))
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    assert {f"train/{name}" for name in REWARDS} | {f"eval/{name}" for name in REWARDS} <= tags
    assert [e.step for e in accumulator.Scalars("train/rewards/accuracy")] == list(range(1, STEPS + 1))
    run_id = json.loads((run_dir / "mlflow.json").read_text())["run_id"]
    history = MlflowClient(tracking_uri=mlflow_uri).get_metric_history(run_id, "eval/rewards/accuracy")
    assert [(m.step, m.value) for m in history] == [(0, 0.0), (STEPS, summary["eval_rewards/accuracy"])]


def test_a_resume_on_one_worker_reads_the_reference_and_continues_the_losses(full_run, dpo_spec, tmp_path):
    """The 2-worker run's step-5 checkpoint and reference/ in a new run directory, resumed on 1 worker with
    grad_accum 2 (the same global batch): steps 6-12 track the uninterrupted run (rel 1e-4: another reduction
    order), and the reference log-probs are read, not scored again (a full fine-tune past step 0 could not)."""
    _, ref_dir = full_run
    run_dir = tmp_path / "resumed"
    shutil.copytree(ref_dir / f"checkpoint_{CHECKPOINT_AT:08d}", run_dir / f"checkpoint_{CHECKPOINT_AT:08d}")
    shutil.copytree(ref_dir / "reference", run_dir / "reference")
    stored = {p.name: p.read_bytes() for p in (run_dir / "reference").iterdir()}
    summary = run_training(dpo_spec(tmp_path, "run.name=resumed", "scaling.workers=1", "train.grad_accum=2"))
    assert summary["finished"] and summary["world_size"] == 1
    assert summary["resumed_from"].endswith(f"checkpoint_{CHECKPOINT_AT:08d}")
    assert reference_events(run_dir) == [("train", False), ("eval", False)]
    assert {p.name: p.read_bytes() for p in (run_dir / "reference").iterdir()} == stored
    got, want = losses(run_dir), losses(ref_dir)
    assert sorted(got) == list(range(CHECKPOINT_AT + 1, STEPS + 1))
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-4), step
    assert summary["eval_rewards/accuracy"] == pytest.approx(full_run[0]["eval_rewards/accuracy"], abs=1e-9)
