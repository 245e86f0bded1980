"""What the driver of `trainlift train` imports before Ray Train starts: not torch, not transformers. The workers
import both anyway; on the driver they were seconds of every start."""

import json
import subprocess
import sys

DRIVER = """
import json, sys
import ray.cloudpickle as cloudpickle
from ray.train import RunConfig, ScalingConfig
import trainlift.cli
from trainlift.config.job import validate_job_spec
from trainlift.train import launch
from trainlift.train.run import preflight, raytrainer

spec = preflight.check(validate_job_spec(json.loads(sys.argv[1])))
launch.prepare_model(spec)
cache = launch.prepare_data(spec)
trainer = raytrainer.torch_trainer(raytrainer.recipe_train_loop, use_gpu=False,
                                   scaling_config=ScalingConfig(num_workers=2),
                                   run_config=RunConfig(name="probe", storage_path=spec.run.storage))
train_fn = cloudpickle.dumps(trainer.train_loop_per_worker)
print(json.dumps({"heavy": [m for m in ("torch", "transformers") if m in sys.modules],
                  "cache_built": any(split["built"] for split in cache.values()), "train_fn_bytes": len(train_fn)}))
"""


def driver_run(spec) -> dict:
    done = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(spec.model_dump(mode="json"))],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_run_with_a_local_model_and_its_data_cache_needs_neither_torch_nor_transformers(tiny_spec):
    from trainlift.train import launch
    from trainlift.train.run import preflight

    spec = preflight.resolve_paths(tiny_spec())
    assert all(split["built"] for split in launch.prepare_data(spec).values())  # a first run tokenizes, here
    again = driver_run(spec)
    assert not again["cache_built"] and again["heavy"] == []
    assert again["train_fn_bytes"] < 200  # the recipe's train function travels by name, not by value


def test_a_full_fine_tune_resuming_without_its_model_path_is_checked_without_torch(tiny_spec, tiny_assets, tmp_path):
    """model.path is gone: the driver takes the model config saved with the newest complete checkpoint."""
    from trainlift.train import launch
    from trainlift.train.run import checkpoint, preflight

    spec = preflight.resolve_paths(tiny_spec(f"model.path={tmp_path / 'gone'}",
                                             f"model.tokenizer={tiny_assets / 'model'}"))
    launch.prepare_data(spec)
    saved = tmp_path / "runs" / spec.run.name / checkpoint.dir_name(3)
    saved.mkdir(parents=True)
    config = json.loads((tiny_assets / "model" / "config.json").read_text())
    (saved / checkpoint.MODEL_CONFIG).write_text(json.dumps(config))
    (saved / checkpoint.MARKER).write_text("{}")
    again = driver_run(spec)
    assert not again["cache_built"] and again["heavy"] == []
