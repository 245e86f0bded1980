"""Benchmark 3: the reference sample's pattern (`ray.train.report()` every step) against trainlift's
boundary-only reporting, and the steps/s ceiling per-step reporting imposes.

    python bench/report_pattern.py [--pairs 2] [--steps 20] [--warmup 3] [--fast-poll 0.5] [--no-record]

Both variants run the same recipe through `trainlift.train.launch.run_training` on one embedded Ray
instance (demo config, 2 workers); the per-step variant wraps the recipe's worker loop so that every
optimizer step ends in a `ray.train.report()` (`reporting_every_step`). One more per-step run with Ray
Train's controller poll shortened (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S) shows what sets the ceiling.
"""

from __future__ import annotations

import argparse
import json
import os

import benchlib as bl

POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"


def reporting_every_step(config: dict) -> None:
    """The recipe's worker loop with a `ray.train.report()` after every optimizer step, as the reference sample
    does. Runs in each Ray Train worker (this script's functions travel by value)."""
    import ray.train

    from trainlift.train import recipe

    read_step = recipe.read_step

    def read_step_and_report(*args, **kwargs):
        result = read_step(*args, **kwargs)
        ray.train.report({"loss": result.loss})
        return result

    recipe.read_step = read_step_and_report
    recipe.train_loop_per_worker(config)


def run(spec_args: list[str], name: str, every_step: bool, warmup: int, work) -> float:
    from trainlift.config.job import load_job_spec
    from trainlift.train.launch import run_training

    spec = load_job_spec(bl.REPO / bl.DEMO_SPEC, [*spec_args, f"run.name={name}", f"run.storage={work / 'runs'}"])
    run_training(spec, train_loop=reporting_every_step if every_step else None)
    rows = [json.loads(line) for line in (work / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    times = [r["time"] for r in rows if "loss" in r]
    return bl.median(bl.periods(times)[warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--fast-poll", type=float, default=0.5, help=f"{POLL_ENV} for the extra per-step run")
    bl.add_common_args(parser)
    args = parser.parse_args()
    bl.configure(args)

    import ray

    from trainlift.ops import localray

    os.chdir(bl.REPO)
    work = bl.workdir("trainlift-bench-report-")
    spec_args = [f"model.path={bl.prebuilt_model(work)}", f"train.steps={args.steps}"]
    for key in ("OMP_NUM_THREADS", "RAY_ADDRESS", POLL_ENV):
        os.environ.pop(key, None)
    localray.start_in_process(num_cpus=max(os.cpu_count() or 1, 2))
    results, loads = {"every step": [], "boundaries only": []}, []
    try:
        for n in range(args.pairs):
            for every_step in (True, False) if n % 2 == 0 else (False, True):
                loads.append(bl.wait_for_quiet())
                label = "every step" if every_step else "boundaries only"
                results[label].append(run(spec_args, f"report-{n}-{int(every_step)}", every_step, args.warmup, work))
                print(f"{label}: {results[label][-1]:.3f} s/step", flush=True)
        os.environ[POLL_ENV] = str(args.fast_poll)
        loads.append(bl.wait_for_quiet())
        fast = run(spec_args, "report-fast-poll", True, args.warmup, work)
    finally:
        os.environ.pop(POLL_ENV, None)
        ray.shutdown()

    every, boundary = bl.median(results["every step"]), bl.median(results["boundaries only"])
    rows = [["`ray.train.report()` every step (reference sample)", "2.0 (default)", f"{every:.3f}", f"{1 / every:.2f}",
             " ".join(f"{v:.3f}" for v in results["every step"])],
            ["trainlift: report at eval/checkpoint boundaries only", "2.0 (default)", f"{boundary:.3f}",
             f"{1 / boundary:.2f}", " ".join(f"{v:.3f}" for v in results["boundaries only"])],
            ["every step, shorter controller poll", f"{args.fast_poll}", f"{fast:.3f}", f"{1 / fast:.2f}", f"{fast:.3f}"]]
    body = [
        f"Demo config, 2 workers, {args.steps} steps per run (no eval or checkpoint boundary inside the window), "
        f"median step-end gap over steps {args.warmup + 2}–{args.steps}; runs alternate between the two patterns.\n",
        bl.table(["pattern", f"{POLL_ENV} s", "median s/step", "steps/s", "runs s/step"], rows),
        f"\nPer-step reporting is **{every / boundary:.1f}× slower** per step than boundary-only reporting on this "
        f"model: it caps a run at about **{1 / every:.2f} steps/s** whatever the model, because each `report()` is a "
        f"barrier that the controller drains once per poll ({POLL_ENV}, default 2.0 s) — with the poll at "
        f"{args.fast_poll} s the same run takes {fast:.3f} s/step. The reference sample's published 0.517 steps/s "
        "on EFA sits at this ceiling. trainlift reports only at evaluation and checkpoint boundaries, so its step "
        "rate is set by compute.",
    ]
    bl.record("3. Per-step reporting (the reference pattern)", loads, "\n".join(body), key="report_pattern")


if __name__ == "__main__":
    main()
