"""Benchmark 13: which of Ray's own start-up knobs shorten Ray Train's start on one machine.

    python bench/ray_start_knobs.py [--rounds 2] [--settle 8] [--no-record]

Each variant runs in a fresh process: an embedded Ray instance started as `trainlift train` starts it
(`localray.start_in_process`, 4 logical CPUs), `--settle` seconds of idle time (what the driver's own
preflight and data cache give Ray's prestarted workers, or a warm head has had), then a 2-worker gloo
`TorchTrainer` whose train function imports what the recipe imports and meets at a barrier. Measured:
seconds from `fit()` to the train function's entry on rank 0, and whether rank 0's worker process was
started before `fit()` (a prestarted worker Ray reused) or after (a fresh process).

Variants:
- base: what trainlift does today.
- preload: `RAY_preload_python_modules=torch,ray.train.torch`: every Python worker Ray starts imports
  them before it accepts work.
- match-env: the job's runtime env carries exactly the env vars Ray Train gives its controller and
  workers, so that their actors could be placed on the job's prestarted workers.
- match-env+preload: both.
- no-dataset-actor: a TorchTrainer without Ray Train's DatasetsCallback (no Ray Data datasets are
  passed), which otherwise starts a DatasetManager actor on every (re)start.
- trainlift: `train.raytrainer.torch_trainer`, what `trainlift train` uses: no dataset actor, and a backend
  config Ray Train's controller unpickles without importing torch.

`--variants` picks some of them (base always runs: the ratios are against it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import benchlib as bl

VARIANTS = ("base", "preload", "match-env", "match-env+preload", "no-dataset-actor", "trainlift")

CHILD = r'''
import json, os, sys, time
variant, settle, marks = sys.argv[1], float(sys.argv[2]), sys.argv[3]
if "preload" in variant:
    os.environ["RAY_preload_python_modules"] = "torch,ray.train.torch"
if "match-env" in variant:
    os.environ["RAY_WARN_BLOCKING_GET_INSIDE_ASYNC"] = "0"  # Ray Train sets it on its controller otherwise
import psutil, ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer
from trainlift.ops import localray

localray.skip_cluster_only_train_features()
if "match-env" in variant:
    from ray.train.v2._internal.constants import get_env_vars_to_propagate
    port = localray.free_port()
    url = f"http://127.0.0.1:{port}"
    ray.init(address="local", num_cpus=4, include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=port,
             log_to_driver=False, _system_config={"worker_niceness": 0},
             runtime_env={"env_vars": {"RAY_API_SERVER_ADDRESS": url, **get_env_vars_to_propagate()}})
else:
    localray.start_in_process(num_cpus=4)
time.sleep(settle)

def train_fn(config):
    entered = time.time()
    import torch.distributed as dist
    import trainlift.train.recipe  # noqa: F401 - what the real train function's module costs
    dist.barrier()
    if dist.get_rank() == 0:
        with open(config["marks"], "w") as fh:
            json.dump({"entered": entered, "pid": os.getpid(),
                       "created": psutil.Process().create_time()}, fh)

Trainer = TorchTrainer
if variant == "no-dataset-actor":
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback

    class Trainer(TorchTrainer):
        def _create_default_callbacks(self):
            return [cb for cb in super()._create_default_callbacks() if not isinstance(cb, DatasetsCallback)]

kwargs = dict(train_loop_config={"marks": marks}, scaling_config=ScalingConfig(num_workers=2),
              run_config=RunConfig(name=f"knobs-{os.getpid()}", storage_path=os.path.dirname(marks)))
if variant == "trainlift":
    from trainlift.train.run import raytrainer

    trainer = raytrainer.torch_trainer(train_fn, use_gpu=False, **kwargs)
else:
    trainer = Trainer(train_fn, torch_config=TorchConfig(backend="gloo"), **kwargs)
fit_at = time.time()
trainer.fit()
with open(marks) as fh:
    m = json.load(fh)
print(json.dumps({"to_entry_s": m["entered"] - fit_at, "prestarted": m["created"] < fit_at}))
ray.shutdown()
'''


def run_variant(variant: str, settle: float, work: str) -> dict:
    marks = os.path.join(work, f"marks-{variant}-{time.time_ns()}.json")
    env = bl.clean_env(RAY_ADDRESS="")
    done = subprocess.run([sys.executable, "-c", CHILD, variant, str(settle), marks], env=env, cwd=bl.REPO,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--settle", type=float, default=8.0)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    bl.add_common_args(parser)
    args = parser.parse_args()
    bl.configure(args)
    variants = ("base", *(v for v in VARIANTS if v in args.variants and v != "base"))
    work = tempfile.mkdtemp(prefix="trainlift-knobs-")
    results: dict[str, list[dict]] = {v: [] for v in variants}
    loads = []
    for round_ in range(args.rounds):
        order = variants[round_ % len(variants):] + variants[:round_ % len(variants)]
        for variant in order:
            loads.append(bl.wait_for_quiet())
            results[variant].append(run_variant(variant, args.settle, work))
            print(variant, results[variant][-1], file=sys.stderr, flush=True)
    base = bl.median([r["to_entry_s"] for r in results["base"]])
    rows = []
    for variant in variants:
        times = [r["to_entry_s"] for r in results[variant]]
        rows.append([variant, f"{bl.median(times):.2f}", " ".join(f"{t:.1f}" for t in times),
                     f"{bl.median(times) / base:.2f}", " ".join("yes" if r["prestarted"] else "no" for r in results[variant])])
    body = (f"`fit()` to the train function's entry on rank 0, 2 gloo workers on an embedded Ray instance (4 logical "
            f"CPUs), {args.settle:.0f} s idle between `ray.init` and `fit()`, {args.rounds} rounds with the order "
            "rotated.\n\n"
            + bl.table(["variant", "median s", "runs s", "× base", "rank 0 on a prestarted worker"], rows))
    bl.record("13. Ray's start-up knobs", loads, body, key="ray_start_knobs")


if __name__ == "__main__":
    main()
