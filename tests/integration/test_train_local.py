"""The recipe on a real local Ray cluster (CPU, gloo, FSDP2) with a tiny Qwen2 model."""

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from trainlift.train.run import checkpoint
from trainlift.train.launch import run_training

pytestmark = pytest.mark.usefixtures("ray_local")


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


ACTORS_OF_THE_RUN: dict = {}  # actor classes before and after `uninterrupted`, and the placement groups it made


def actor_classes() -> Counter:
    """How many actors of each class the shared Ray instance has had (live or dead), from its GCS: the embedded
    instance has no dashboard, so no state API."""
    from ray._private import state

    return Counter(actor["ActorClassName"] for actor in state.actors().values())


def placement_group_states() -> dict[str, str]:
    import ray

    return {pg_id: pg["state"] for pg_id, pg in ray.util.placement_group_table().items()}


@pytest.fixture(scope="module")
def uninterrupted(tiny_assets, tmp_path_factory):
    """A 6-step, 2-worker run that checkpoints every 3 steps: the reference the other tests compare to."""
    from trainlift.config.job import validate_job_spec

    storage = tmp_path_factory.mktemp("ref")
    spec = validate_job_spec({
        "model": {"path": str(tiny_assets / "model")},
        "data": {"train": str(tiny_assets / "train.jsonl"), "eval": str(tiny_assets / "eval.jsonl"), "seq_len": 64},
        "train": {"steps": 6, "micro_batch_size": 2, "lr": 1e-3, "warmup_steps": 1, "seed": 0},
        "checkpoint": {"every_steps": 3, "keep": 2},
        "run": {"name": "ref", "storage": str(storage), "max_failures": 0},
    })
    before, groups_before = actor_classes(), placement_group_states()
    summary = run_training(spec)
    ACTORS_OF_THE_RUN.update(before=before, after=actor_classes())
    ACTORS_OF_THE_RUN["groups"] = {pg: s for pg, s in placement_group_states().items() if pg not in groups_before}
    return summary, storage / "ref"


def test_run_writes_metrics_summary_checkpoints_and_export(uninterrupted):
    summary, run_dir = uninterrupted
    assert summary["finished"] and summary["steps"] == 6 and summary["world_size"] == 2
    assert sorted(losses(run_dir)) == [1, 2, 3, 4, 5, 6]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_row = next(r for r in rows if r.get("step") == 2 and "loss" in r)
    assert {"lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s"} <= step_row.keys()
    assert any("eval_loss" in r for r in rows)
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert on_disk["steps"] == 6 and on_disk["eval_loss"] == summary["eval_loss"] and on_disk["mfu"] is None
    assert [s for s, _, done in checkpoint.list_checkpoints(checkpoint.pafs.LocalFileSystem(), str(run_dir)) if done] == [3, 6]


def test_a_run_starts_only_its_own_actors_and_frees_its_placement_group(uninterrupted):
    """Ray Train's DatasetManager (Ray Data shards; trainlift passes no datasets) and PlacementGroupCleaner actors
    are left out of a run, while the run's own actors (its controller and two workers) show up in the same Ray
    instance's actor list; the worker group's placement group is removed when the run ends, without the cleaner."""
    new = ACTORS_OF_THE_RUN["after"] - ACTORS_OF_THE_RUN["before"]
    assert new["TrainController"] == 1 and new["RayTrainWorker"] == 2, new
    assert new["DatasetManager"] == 0 and new["PlacementGroupCleaner"] == 0, new
    assert list(ACTORS_OF_THE_RUN["groups"].values()) == ["REMOVED"]


def test_export_loads_and_matches_the_trained_weights(uninterrupted, tiny_assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, run_dir = uninterrupted
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "final").eval()
    trained = AutoModelForCausalLM.from_pretrained(tiny_assets / "model").eval()
    checkpoint.load_weights_unsharded(str(run_dir / "checkpoint_00000006"), trained)
    batch = torch.randint(0, exported.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(batch).logits, trained(batch).logits, rtol=1e-5, atol=1e-5)
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final")
    prompt = tokenizer("<|user|>\nadd 1 2\n<|assistant|>\n", return_tensors="pt")
    # min_new_tokens: the comparison covers four generated tokens even if the model says eos at once.
    out = exported.generate(**prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 4
    assert torch.equal(out, trained.generate(**prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False))


def test_async_checkpoints_train_the_same_losses_as_sync_ones(uninterrupted, tiny_spec):
    """`uninterrupted` checkpoints asynchronously (the default); the same run with `checkpoint.mode: sync` has the
    same losses, the same complete checkpoints, and both say how long each save held the loop."""
    summary, ref_dir = uninterrupted
    spec = tiny_spec("run.name=sync", "checkpoint.every_steps=3", "checkpoint.keep=2", "checkpoint.mode=sync")
    sync_summary = run_training(spec)
    sync_dir = Path(spec.run_uri)
    assert losses(sync_dir) == pytest.approx(losses(ref_dir), rel=1e-6)
    fs = checkpoint.pafs.LocalFileSystem()
    for run_dir in (ref_dir, sync_dir):
        assert [s for s, _, done in checkpoint.list_checkpoints(fs, str(run_dir)) if done] == [3, 6]
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        held = [r for r in rows if r.get("event") == "checkpoint"]
        assert [r["step"] for r in held] == [3, 6] and all(r["checkpoint_blocked_s"] > 0 for r in held)
    assert summary["checkpoint_blocked_s"] > 0 and sync_summary["checkpoint_blocked_s"] > 0


def test_a_stop_checkpoints_even_without_periodic_checkpoints(tiny_spec):
    spec = tiny_spec("run.name=stop-no-periodic", "checkpoint.every_steps=0", "train.eval_every=0")
    assert run_training(spec, stop_at_step=2)["steps"] == 2
    fs = checkpoint.pafs.LocalFileSystem()
    assert [(s, done) for s, _, done in checkpoint.list_checkpoints(fs, spec.run_uri)] == [(2, True)]


def test_stop_and_resume_reproduces_the_uninterrupted_losses_from_the_checkpoint_alone(
        uninterrupted, tiny_spec, tiny_assets, tmp_path):
    """Same data order, same RNG: steps 5-6 after a resume equal the uninterrupted run's (fp32, tol 1e-6).
    The first run pruned checkpoint 2 (keep=1) before stopping: the rerun still starts. A full fine-tune whose
    model.path is deleted after the stop: the restart reads only the checkpoint (weights and model config)."""
    import shutil

    _, ref_dir = uninterrupted
    base = tmp_path / "base"
    shutil.copytree(tiny_assets / "model", base)
    spec = tiny_spec("run.name=resume", f"model.path={base}", f"model.tokenizer={tiny_assets / 'model'}",
                     "checkpoint.every_steps=2", "checkpoint.keep=1")
    first = run_training(spec, stop_at_step=4)
    assert not first["finished"] and first["steps"] == 4
    assert not (Path(spec.run_uri) / "checkpoint_00000002").exists()
    shutil.rmtree(base)
    second = run_training(spec)
    assert second["finished"] and second["resumed_from"].endswith("checkpoint_00000004")
    got, want = losses(Path(spec.run_uri)), losses(ref_dir)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        assert got[step] == pytest.approx(want[step], rel=1e-6), step


@pytest.mark.parametrize("save_workers,resume_workers", [(1, 2)])
def test_checkpoint_reshards_to_a_different_worker_count(uninterrupted, tiny_spec, save_workers, resume_workers):
    """Global batch held equal (workers x grad_accum = 2), so the resumed losses track the 2-worker
    reference; a different reduction order allows a small tolerance (rel 1e-4). (2 -> 1 is the elastic case,
    run in tests/integration/test_lost_host.py.)"""
    _, ref_dir = uninterrupted
    name = f"reshard{save_workers}to{resume_workers}"
    accum = {1: 2, 2: 1}
    saving = tiny_spec(f"run.name={name}", f"scaling.workers={save_workers}", f"train.grad_accum={accum[save_workers]}")
    run_training(saving, stop_at_step=3)
    resuming = tiny_spec(f"run.name={name}", f"scaling.workers={resume_workers}", f"train.grad_accum={accum[resume_workers]}")
    summary = run_training(resuming)
    assert summary["world_size"] == resume_workers and summary["resumed_from"].endswith("checkpoint_00000003")
    got, want = losses(Path(resuming.run_uri)), losses(ref_dir)
    for step in (4, 5, 6):
        assert got[step] == pytest.approx(want[step], rel=1e-4), step


def test_doctor_refuses_to_train_on_a_broken_stack_unless_skipped(tiny_spec):
    """expect_fabric=efa on a machine with no EFA device: the workers' stack check stops the run."""
    from trainlift.errors import TrainliftError

    spec = tiny_spec("run.name=doctor", "scaling.expect_fabric=efa", "train.steps=2", "checkpoint.every_steps=0")
    with pytest.raises(TrainliftError, match="trainlift doctor found .* error"):
        run_training(spec)
    summary = run_training(spec, skip_doctor=True)
    assert summary["finished"] and summary["steps"] == 2


def test_a_worker_death_is_explained_with_rays_notice_which_stays_off_the_console(tiny_spec, capfd):
    """Ray's own lines go to the run's driver.log, not the console; the raylet's notice that a worker died is
    part of the one-line failure. (A worker that exits at once stands in for one killed by the OOM killer.)"""
    from trainlift.errors import TrainliftError

    def dying_loop(config):
        import os

        import ray.train

        if ray.train.get_context().get_world_rank() == 1:
            os._exit(1)
        import time

        time.sleep(60)

    spec = tiny_spec("run.name=dies", "run.max_failures=0")
    capfd.readouterr()
    with pytest.raises(TrainliftError) as failure:
        run_training(spec, train_loop=dying_loop)
    line = failure.value.one_line()
    log = Path(spec.run_uri) / "driver.log"
    assert "(before it, Ray said: A worker died or was killed while executing a task" in line and "\n" not in line
    assert f"every line Ray printed is in {log}" in line
    console = capfd.readouterr()
    assert "A worker died" not in console.out + console.err and "TrainController" not in console.out + console.err
    text = log.read_text()
    assert "(raylet) A worker died or was killed" in text
