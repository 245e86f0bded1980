"""Ray Train's TorchTrainer without the one part trainlift has no use for.

Ray Train V2 starts a `DatasetManager` actor on every worker-group (re)start to hand out Ray Data
shards, whether or not any dataset was passed. trainlift passes none (workers map the data cache
themselves), and on one machine that actor is a Python process importing Ray next to the workers
importing torch: without it, `fit()` reaches the train function in 0.77× the time (docs/BENCHMARKS.md,
benchmark 13). The hook is Ray's private `_create_default_callbacks`; where a Ray release lacks it or the
callback class moved, this is the plain TorchTrainer.
"""

from __future__ import annotations


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
