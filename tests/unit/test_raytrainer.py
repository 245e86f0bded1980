"""The backend config trainlift hands Ray Train: its controller (a fresh process per run) must not import torch."""

import subprocess
import sys

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


def test_a_ray_release_without_the_worker_steps_gets_rays_own_config(monkeypatch):
    from ray.train.torch import config as ray_torch_config

    monkeypatch.delattr(ray_torch_config, "_setup_torch_process_group")
    assert type(raytrainer.torch_config("gloo")) is TorchConfig
