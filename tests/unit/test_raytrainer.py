"""The backend config trainlift hands Ray Train: its controller (a fresh process per run) must not import torch."""

import subprocess
import sys

import pytest

import ray.cloudpickle as cloudpickle
from ray.train.torch import TorchConfig

from trainlift.train.run import raytrainer

# What the controller does with the config: unpickle it and ask for its backend, framework and train-function context.
CONTROLLER = """
import sys
import ray.cloudpickle as cloudpickle
config = cloudpickle.loads(sys.stdin.buffer.read())
config.backend_cls, config.framework, config.train_func_context
print(config.backend, "torch" in sys.modules)
"""


def unpickled_in_a_fresh_process(config) -> str:
    done = subprocess.run([sys.executable, "-c", CONTROLLER], input=cloudpickle.dumps(config), capture_output=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return done.stdout.decode().strip()


def test_the_backend_config_reaches_the_controller_without_torch():
    assert unpickled_in_a_fresh_process(raytrainer.torch_config("gloo")) == "gloo False"
    assert unpickled_in_a_fresh_process(TorchConfig(backend="gloo")) == "gloo True"  # what Ray's own config costs


def test_nccl_on_gpus_and_gloo_on_cpus():
    assert raytrainer.torch_config("nccl").backend == "nccl"
    assert raytrainer.torch_config("gloo").to_dict() == TorchConfig(backend="gloo").to_dict()


ALL_PRIVATE = {**raytrainer.BACKEND_NAMES, **raytrainer.TRAINER_NAMES, **raytrainer.COORDINATOR_NAMES,
               **raytrainer.SIGNAL_NAMES}


def test_every_private_ray_name_used_is_in_the_pinned_ray_as_read_from_its_source():
    """The fast path is live with the pinned Ray, and reading the source agrees with importing the modules."""
    import importlib

    assert raytrainer.private_names_missing(ALL_PRIVATE) == []
    for module, names in ALL_PRIVATE.items():
        loaded = importlib.import_module(module)
        for name in names:
            owner, _, attribute = name.rpartition(".")
            assert hasattr(getattr(loaded, owner) if owner else loaded, attribute), f"{module}:{name}"


def without(monkeypatch, gone: str):
    """A Ray release whose source lacks `module:name`."""
    module, name = gone.split(":")
    defined = raytrainer.names_defined_in
    monkeypatch.setattr(raytrainer, "names_defined_in", lambda m: defined(m) - {name} if m == module else defined(m))


@pytest.mark.parametrize("gone", [f"{m}:{n}" for m, names in raytrainer.BACKEND_NAMES.items() for n in names])
def test_a_ray_release_without_a_backend_name_gets_rays_own_config(monkeypatch, gone):
    without(monkeypatch, gone)
    assert type(raytrainer.torch_config("gloo")) is TorchConfig


@pytest.mark.parametrize("gone", [f"{m}:{n}" for m, names in raytrainer.TRAINER_NAMES.items() for n in names])
def test_a_ray_release_without_a_trainer_name_gets_rays_plain_torch_trainer(monkeypatch, gone):
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    without(monkeypatch, gone)
    trainer = raytrainer.torch_trainer(lambda config: None, use_gpu=False, scaling_config=ScalingConfig(num_workers=1))
    assert type(trainer).__mro__[1] is TorchTrainer  # Ray's own, leaving SIGINT to the driver


def test_rays_sigint_handler_is_left_out_where_ray_has_it_and_kept_where_it_does_not(monkeypatch):
    """Ray Train V2's handler aborts on the first Ctrl-C without a checkpoint; the driver's checkpoints first."""
    from ray.train import ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    def build():
        return raytrainer.torch_trainer(lambda config: None, use_gpu=False,
                                        scaling_config=ScalingConfig(num_workers=1))

    installed = []
    monkeypatch.setattr("signal.signal", lambda sig, handler: installed.append(sig))
    build()._register_sigint_handler(controller=None)
    assert installed == []
    (module, (name,)), = raytrainer.SIGNAL_NAMES.items()
    without(monkeypatch, f"{module}:{name}")
    trainer = build()
    assert type(trainer)._register_sigint_handler is DataParallelTrainer._register_sigint_handler


def test_the_pinned_ray_gets_the_trimmed_trainer_and_a_missing_coordinator_is_skipped(monkeypatch):
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = raytrainer.torch_trainer(lambda config: None, use_gpu=False, scaling_config=ScalingConfig(num_workers=1))
    assert type(trainer).__name__ == "TrainerWithoutUnusedActors" and not isinstance(trainer, TorchTrainer)
    import importlib

    (module, (name,)), = raytrainer.COORDINATOR_NAMES.items()
    called = []
    monkeypatch.setattr(importlib.import_module(module), name, lambda: called.append(name))
    raytrainer.start_autoscaling_coordinator()
    without(monkeypatch, f"{module}:{name}")
    raytrainer.start_autoscaling_coordinator()
    assert called == [name]  # called once, with the name there; skipped without it
