"""Ray Train's TorchTrainer without two costs trainlift has no use for, both paid on every run's start.

- Ray Train V2 starts a `DatasetManager` actor on every worker-group (re)start to hand out Ray Data
  shards, whether or not any dataset was passed. trainlift passes none (workers map the data cache
  themselves), and on one machine that actor is a Python process importing Ray next to the workers
  importing torch: without it, `fit()` reaches the train function in 0.77x the time (docs/BENCHMARKS.md,
  benchmark 13). The hook is Ray's private `_create_default_callbacks`; where a Ray release lacks it or
  the callback class moved, this is the plain TorchTrainer.
- Ray Train unpickles the backend config in its controller, a fresh process on every run.
  `ray.train.torch.TorchConfig` lives in a module that imports torch, so each start waited for the
  controller to import torch before it created anything else (ready 4.4 s after `fit()` on 2 cores,
  1.6 s without torch). `TorchBackendConfig` and `TorchBackend` hold only names: every step runs Ray's
  own function from `ray.train.torch.config` on the workers (which import torch anyway), in the order
  Ray's `_TorchBackend` runs them. Where a Ray release renames those functions, this is Ray's
  TorchConfig. With both, `fit()` reaches the train function in 0.67x Ray's plain TorchTrainer's time
  (benchmark 13).

This module imports neither torch nor `ray.train.torch` at import time: the controller imports it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import ray
from ray.train.backend import Backend, BackendConfig

RAY_WORKER_STEPS = ("_setup_torch_process_group", "_set_torch_distributed_env_vars", "_shutdown_torch",
                    "TorchConfigContextManager")


def torch_trainer(train_loop_per_worker, *, use_gpu: bool, **trainer_kwargs):
    """A TorchTrainer for `train_loop_per_worker` on NCCL (GPUs) or gloo (CPUs)."""
    return torch_trainer_class()(train_loop_per_worker, torch_config=torch_config("nccl" if use_gpu else "gloo"),
                                 **trainer_kwargs)


def torch_config(backend: str):
    from ray.train.torch import config as ray_torch_config

    if all(hasattr(ray_torch_config, name) for name in RAY_WORKER_STEPS):
        return TorchBackendConfig(backend=backend)
    return ray_torch_config.TorchConfig(backend=backend)


def torch_trainer_class():
    from ray.train.torch import TorchTrainer

    try:
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    except ImportError:
        return TorchTrainer
    if not hasattr(TorchTrainer, "_create_default_callbacks"):
        return TorchTrainer

    class TorchTrainerWithoutDatasets(TorchTrainer):
        def _create_default_callbacks(self):
            callbacks = super()._create_default_callbacks()
            if self.datasets:
                return callbacks
            return [cb for cb in callbacks if not isinstance(cb, DatasetsCallback)]

    return TorchTrainerWithoutDatasets


def _on_worker(step: str, **kwargs):
    from ray.train.torch import config as ray_torch_config

    return getattr(ray_torch_config, step)(**kwargs)


def _set_master(addr: str, port: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)


class TrainFuncContext:
    """Ray's TorchConfigContextManager (it sets each GPU worker's CUDA device), entered on the worker."""

    def __enter__(self):
        from ray.train.torch.config import TorchConfigContextManager

        self._inner = TorchConfigContextManager()
        return self._inner.__enter__()

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)


@dataclass
class TorchBackendConfig(BackendConfig):
    backend: str = "gloo"
    timeout_s: int = 1800

    @property
    def backend_cls(self):
        return TorchBackend

    @property
    def train_func_context(self):
        return TrainFuncContext

    @property
    def framework(self):
        from ray.train.v2._internal.util import TrainingFramework

        return TrainingFramework.TORCH

    def to_dict(self) -> dict:
        return {"backend": self.backend, "init_method": "env", "timeout_s": self.timeout_s}


class TorchBackend(Backend):
    share_cuda_visible_devices: bool = True

    def on_start(self, worker_group, backend_config: TorchBackendConfig) -> None:
        from ray.train._internal.utils import get_address_and_port

        addr, port = worker_group.execute_single(0, get_address_and_port)
        worker_group.execute(_set_master, addr, port)
        worker_group.execute(_on_worker, "_set_torch_distributed_env_vars")
        world = len(worker_group)
        ray.get([worker_group.execute_single_async(rank, _on_worker, "_setup_torch_process_group",
                                                   backend=backend_config.backend, world_rank=rank, world_size=world,
                                                   init_method="env://", timeout_s=backend_config.timeout_s)
                 for rank in range(world)])

    def on_shutdown(self, worker_group, backend_config: TorchBackendConfig) -> None:
        from ray._private import ray_constants
        from ray.exceptions import GetTimeoutError
        from ray.train.constants import DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S

        futures = worker_group.execute_async(_on_worker, "_shutdown_torch", destroy_process_group=len(worker_group) > 1)
        timeout_s = ray_constants.env_integer(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
                                              DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S)
        try:
            ray.get(futures, timeout=timeout_s)
        except GetTimeoutError:
            pass  # as Ray's backend: a worker that cannot leave its process group is torn down with its actor
