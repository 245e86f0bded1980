"""Ray Train's TorchTrainer without the costs trainlift has no use for, all paid on every run's start.

- Ray Train V2 starts a `DatasetManager` actor on every worker-group (re)start to hand out Ray Data
  shards, whether or not any dataset was passed. trainlift passes none (workers map the data cache
  themselves), and on one machine that actor is a Python process importing Ray next to the workers
  importing torch: without it, `fit()` reaches the train function in 0.77x the time (docs/BENCHMARKS.md,
  benchmark 13). The hook is Ray's private `_create_default_callbacks`; where a Ray release lacks it or
  the callback classes moved, this is the plain trainer.
- Ray Train V2 also starts a detached `PlacementGroupCleaner` actor per run, which removes the run's
  placement group if the controller dies while its driver lives on (a Tune driver running many trials).
  A trainlift driver runs one `fit()` and exits, and Ray removes a job's placement groups when the job
  ends; the cleaner was one more process on the start's critical path, and it holds the end of every run
  until its state-API lookup of the controller answers, which needs a dashboard.
- Ray Train unpickles the backend config in its controller, a fresh process on every run.
  `ray.train.torch.TorchConfig` lives in a module that imports torch, so each start waited for the
  controller to import torch before it created anything else (ready 4.4 s after `fit()` on 2 cores,
  1.6 s without torch). `TorchBackendConfig` and `TorchBackend` hold only names: every step runs Ray's
  own function from `ray.train.torch.config` on the workers (which import torch anyway), in the order
  Ray's `_TorchBackend` runs them. Where a Ray release renames those functions, this is Ray's
  TorchConfig. With both, `fit()` reaches the train function in 0.67x Ray's plain TorchTrainer's time
  (benchmark 13).
- The trainer is Ray Train V2's `DataParallelTrainer` given that backend config (what `TorchTrainer`
  does), and the train function is `recipe_train_loop`, which travels by name: importing
  `ray.train.torch` or the recipe imports torch, which the driver does not otherwise need.

This module imports neither torch nor `ray.train.torch` at import time: the controller imports it.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import logging
import os
from dataclasses import dataclass

import ray
from ray.train.backend import Backend, BackendConfig

log = logging.getLogger(__name__)

# Every private Ray name this module uses, by module, checked against Ray 2.60 (tests/unit/test_raytrainer.py runs
# against the installed Ray). Each group has a public fallback, so a release without one of its names (the DLC's
# 2.58 included, should it differ) gets Ray's own TorchConfig, its plain TorchTrainer, or no early coordinator.
# `private_names_missing` reads Ray's source, so the check imports no torch.
BACKEND_NAMES = {
    "ray.train.torch.config": ("_setup_torch_process_group", "_set_torch_distributed_env_vars", "_shutdown_torch",
                               "TorchConfigContextManager"),
    "ray.train.v2._internal.util": ("TrainingFramework",),
    "ray.train._internal.utils": ("get_address_and_port",),
    "ray._private.ray_constants": ("env_integer",),
}
TRAINER_NAMES = {
    "ray.train.v2.api.data_parallel_trainer": ("DataParallelTrainer", "DataParallelTrainer._create_default_callbacks"),
    "ray.train.v2._internal.callbacks.datasets": ("DatasetsCallback",),
    "ray.train.v2._internal.callbacks.placement_group_callback": ("PlacementGroupCleanerCallback",),
}
SIGNAL_NAMES = {
    "ray.train.v2.api.data_parallel_trainer": ("DataParallelTrainer._register_sigint_handler",),
}
COORDINATOR_NAMES = {
    "ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator": ("get_or_create_autoscaling_coordinator",),
}
RAY_WORKER_STEPS = BACKEND_NAMES["ray.train.torch.config"]


def private_names_missing(names: dict[str, tuple[str, ...]]) -> list[str]:
    """The `module:name` entries of `names` that this Ray release does not define (`Class.method` for methods)."""
    missing = []
    for module, wanted in names.items():
        defined = names_defined_in(module)
        missing += [f"{module}:{name}" for name in wanted if name not in defined]
    return missing


@functools.cache
def names_defined_in(module: str) -> frozenset[str]:
    """Top-level functions, classes, assignments and imports of `module`, and `Class.method` names, from its source.
    The file is found from its top package's directory: importing (or `find_spec` of) a submodule would import its
    parent packages, and `ray.train.torch` imports torch."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    base = os.path.join(spec.submodule_search_locations[0], *rest)
    source = next((path for path in (f"{base}.py", os.path.join(base, "__init__.py")) if os.path.isfile(path)), None)
    if source is None:
        return frozenset()
    with open(source, encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names |= {f"{node.name}.{item.name}" for item in node.body
                          if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.ImportFrom):
            names |= {alias.asname or alias.name for alias in node.names}
    return frozenset(names)


def _fallback(names: dict[str, tuple[str, ...]], instead: str) -> bool:
    """Whether this Ray lacks any of `names`; says once, in the log, which and what is used instead."""
    missing = private_names_missing(names)
    if missing:
        log.info("Ray %s lacks %s: using %s", ray.__version__, ", ".join(missing), instead)
    return bool(missing)


def start_autoscaling_coordinator() -> None:
    """Ray Train's controller registers the run's resources with this node's `AutoscalingCoordinator` (a detached
    actor it creates when missing) and waits for the answer, so on a fresh Ray instance each start waited for
    that process too. Called by the driver once Ray is up, it starts while the driver still prepares the run
    (and, from a job without a runtime env, in one of Ray's prestarted workers). A no-op where a Ray release
    has no such actor."""
    if _fallback(COORDINATOR_NAMES, "no early autoscaling coordinator"):
        return
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )

    get_or_create_autoscaling_coordinator()


class RecipeTrainLoop:
    """The training recipe's train function, by name: unpickled on a worker it is that function itself (so a
    worker's traceback and Ray's error snippet start at the recipe), and the driver never imports the recipe."""

    def __call__(self, config: dict) -> None:
        recipe_train_function()(config)

    def __reduce__(self):
        return recipe_train_function, ()


def recipe_train_function():
    from trainlift.train import recipe

    return recipe.train_loop_per_worker


recipe_train_loop = RecipeTrainLoop()


def torch_trainer(train_loop_per_worker, *, use_gpu: bool, **trainer_kwargs):
    """A trainer running `train_loop_per_worker` on every worker of a torch process group: NCCL (GPUs) or gloo."""
    backend_config = torch_config("nccl" if use_gpu else "gloo")
    if _fallback(TRAINER_NAMES, "Ray's TorchTrainer with all its actors"):
        from ray.train.torch import TorchTrainer

        return keeping_the_drivers_sigint(TorchTrainer)(train_loop_per_worker, torch_config=backend_config,
                                                        **trainer_kwargs)
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    trainer_class = keeping_the_drivers_sigint(without_unused_actors(DataParallelTrainer))
    return trainer_class(train_loop_per_worker, backend_config=backend_config, **trainer_kwargs)


def keeping_the_drivers_sigint(trainer_class):
    """`trainer_class` leaving SIGINT to the driver. Ray Train V2 installs its own handler inside `fit()`, over the
    driver's: a first Ctrl-C aborts the run without a checkpoint. trainlift's (`board.stop_on_signals`) treats
    SIGINT as it treats SIGTERM: checkpoint at the next step boundary, then stop; a second one stops at once."""
    if _fallback(SIGNAL_NAMES, "Ray's own SIGINT handler (Ctrl-C aborts the run without a checkpoint)"):
        return trainer_class

    class TrainerKeepingSigint(trainer_class):
        def _register_sigint_handler(self, controller) -> None:
            pass

    TrainerKeepingSigint.__name__ = TrainerKeepingSigint.__qualname__ = trainer_class.__name__
    return TrainerKeepingSigint


def torch_config(backend: str):
    if not _fallback(BACKEND_NAMES, "Ray's TorchConfig (the controller imports torch)"):
        return TorchBackendConfig(backend=backend)
    from ray.train.torch import config as ray_torch_config

    return ray_torch_config.TorchConfig(backend=backend)


def without_unused_actors(trainer_class):
    """`trainer_class` without Ray Data's DatasetManager (when no datasets are passed) and the placement-group
    cleaner."""
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    class TrainerWithoutUnusedActors(trainer_class):
        def _create_default_callbacks(self):
            unused = (PlacementGroupCleanerCallback,) if self.datasets else (PlacementGroupCleanerCallback, DatasetsCallback)
            return [cb for cb in super()._create_default_callbacks() if not isinstance(cb, unused)]

    return TrainerWithoutUnusedActors


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
        except GetTimeoutError:  # as Ray's backend: the worker is torn down with its actor
            log.warning("torch process group shutdown timed out after %s s (%s); the workers are stopped with their "
                        "actors", timeout_s, TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S)
