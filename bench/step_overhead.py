"""Benchmarks 1 and 6: steady-state step time and peak worker memory, `trainlift train` against torchrun.

    python bench/step_overhead.py [--pairs 3] [--steps 60] [--warmup 10] [--no-record]

(a) `trainlift train examples/tiny-local.yaml` (embedded Ray, 2 workers, 1 CPU each) and (b) the same
model, data, micro-batch, sequence length and worker count trained by bench/torchrun_fsdp.py under
`torchrun --nproc-per-node 2`, run A B A B ... so drift cancels. A step's time is the gap between
consecutive step ends, so everything the loop does per step counts (trainlift's metrics row, progress
update and stop poll included). Each worker's peak RSS (VmHWM) is sampled from outside in the same runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import benchlib as bl

TARGET = 1.05
IMPORT_PROBES = {
    "torch + transformers + trainlift.train.data.examples (what a torchrun worker imports)":
        "import torch, transformers, trainlift.train.data.examples, trainlift.train.model.build",
    "+ ray, ray.train.torch, trainlift.train.recipe (what a Ray Train worker imports)":
        "import torch, transformers, trainlift.train.data.examples, trainlift.train.model.build, ray, ray.train.torch, "
        "trainlift.train.recipe",
}


def import_rss_mib(code: str, env: dict) -> float:
    """Peak RSS of a fresh interpreter that only imports `code`'s modules."""
    probe = f"{code}\nimport resource; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def trainlift_periods(run: dict, warmup: int) -> tuple[list[float], list[float]]:
    rows = run["steps"]
    return bl.periods([r["time"] for r in rows])[warmup:], [r["step_time_s"] for r in rows][warmup + 1:]


def fmt_threads(pairs) -> str:
    return ", ".join(f"{threads} (OMP_NUM_THREADS={omp})" for threads, omp in pairs)


def cpu_rows(pairs: list[dict]) -> list[list[str]]:
    labels = sorted({k for p in pairs for side in ("a_cpu", "b_cpu") for k in p[side]},
                    key=lambda k: -max(p[side].get(k, 0.0) for p in pairs for side in ("a_cpu", "b_cpu")))
    rows = []
    for label in labels:
        a, b = (bl.median([p[side].get(label, 0.0) for p in pairs]) for side in ("a_cpu", "b_cpu"))
        if a >= 0.005 or b >= 0.005:
            rows.append([f"`{label}`", f"{a:.3f}" if a else "—", f"{b:.3f}" if b else "—"])
    workers = ("ray::RayTrainWorker", "torchrun_fsdp.py")
    for name, pick in (("all training workers", lambda k: k in workers), ("everything else", lambda k: k not in workers)):
        a, b = (bl.median([sum(v for k, v in p[side].items() if pick(k)) for p in pairs]) for side in ("a_cpu", "b_cpu"))
        rows.append([f"**{name}**", f"{a:.3f}", f"{b:.3f}"])
    return rows


def sink_cost_us(trackers: list[str], rows: int = 2000) -> tuple[float, float]:
    """Per row: wall µs one `sink.write(row)` holds up the training loop, and CPU µs the whole sink spends on it
    (this process, the trackers' thread and their final flush included), trackers or none."""
    import tempfile
    import time

    import pyarrow.fs as pafs

    from trainlift.config.job import validate_job_spec
    from trainlift.train.run import trackers as tracking

    root = tempfile.mkdtemp(prefix="trainlift-bench-sink-")
    spec = validate_job_spec({"model": {"path": "m"}, "data": {"train": "t.jsonl"},
                              "run": {"name": "sink", "storage": root, "trackers": trackers,
                                      "mlflow_uri": f"file://{root}/mlruns"}})
    sink = tracking.open_sink(spec, pafs.LocalFileSystem(), f"{root}", 0)
    row = {"step": 0, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "world": 2, "tokens": 2048, "tokens_per_s": 1e4,
           "step_time_s": 0.2, "mfu": None, "time": 0.0}
    cpu_start, start = time.process_time(), time.perf_counter()
    for step in range(1, rows + 1):
        sink.write({**row, "step": step, "time": time.time()})
    elapsed = time.perf_counter() - start
    sink.close()
    return elapsed / rows * 1e6, (time.process_time() - cpu_start) / rows * 1e6


def trackers_on_vs_off(args) -> None:
    """(a) `trainlift train` with no trackers, (b) the same with run.trackers=[tensorboard, mlflow] (an MLflow
    file store), run A B A B ...; the step period of (b) over that of (a)."""
    work = bl.workdir("trainlift-bench-trackers-")
    model = bl.prebuilt_model(work)
    env = bl.clean_env(TRAINLIFT_HOME=str(work / "home"), PYTHONPATH=str(bl.REPO / "src"), MLFLOW_ALLOW_FILE_STORE="true")
    on = ["--set", "run.trackers=[tensorboard,mlflow]", "--set", f"run.mlflow_uri=file://{work / 'mlruns'}"]
    pairs, loads = [], []
    for n in range(args.pairs):
        runs = {}
        for side, extra in (("off", []), ("on", on)):
            loads.append(bl.wait_for_quiet())
            run = bl.trainlift_train(["--steps", str(args.steps), "--set", f"model.path={model}", *extra],
                                     work / "runs", f"trackers-{side}-{n}", env)
            runs[side] = bl.median(trainlift_periods(run, args.warmup)[0])
        pairs.append(runs)
        print(f"pair {n + 1}: off {runs['off'] * 1000:.1f} ms, on {runs['on'] * 1000:.1f} ms", flush=True)
    off, on_ = bl.median([p["off"] for p in pairs]), bl.median([p["on"] for p in pairs])
    ratio = on_ / off
    rows = [[n + 1, f"{p['off'] * 1000:.1f}", f"{p['on'] * 1000:.1f}", f"{p['on'] / p['off']:.3f}"]
            for n, p in enumerate(pairs)]
    rows.append(["median", f"{off * 1000:.1f}", f"{on_ * 1000:.1f}", f"{ratio:.3f}"])
    costs = {"none (metrics.jsonl only)": sink_cost_us([]), "tensorboard + mlflow": sink_cost_us(["tensorboard", "mlflow"])}
    per_row = [[name, f"{wall:.1f}", f"{cpu:.1f}"] for name, (wall, cpu) in costs.items()]
    extra_cpu_s = (costs["tensorboard + mlflow"][1] - costs["none (metrics.jsonl only)"][1]) / 1e6
    spread = (min(p["on"] / p["off"] for p in pairs), max(p["on"] / p["off"] for p in pairs))
    resolved = spread[1] - spread[0] <= 0.02
    verdict = ("met" if ratio <= 1.01 else "missed") if resolved else (
        f"not resolved end to end: the pair ratios spread {spread[0]:.3f}–{spread[1]:.3f}, wider than the 1% "
        "asked for, at this load")
    body = [
        f"Demo config, 2 workers, {args.steps} steps per run, median step period over steps {args.warmup + 2}–"
        f"{args.steps}, pairs run (a) then (b).\n",
        bl.table(["pair", "(a) no trackers ms/step", "(b) TensorBoard + MLflow ms/step", "(b)/(a)"], rows),
        f"\n**Ratio (b)/(a) = {ratio:.3f}** (target ≤ 1.01): **{verdict}**.\n",
        "What the sink costs per row, measured in this process (mean of 2000 rows): the wall time `sink.write` "
        "holds up the training loop, and the CPU the whole sink spends (trackers' thread and final flush "
        "included; on a machine whose cores are all training, this CPU comes out of rank 0):\n",
        bl.table(["trackers", "wall µs per write", "CPU µs per row"], per_row),
        f"\nThe trackers' extra CPU is **{extra_cpu_s * 1e3:.3f} ms per step = {extra_cpu_s / off:.2%}** of the "
        f"median step without trackers ({off * 1000:.1f} ms): the bound on what they can add to a step.\n",
    ]
    bl.record("1b. Step overhead: trackers on vs off", loads, "\n".join(body), key="step_overhead_trackers")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60,
                        help="steps per run; keep below the demo's 100-step eval/checkpoint interval")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the median")
    parser.add_argument("--trackers", action="store_true",
                        help="instead: trainlift with run.trackers [tensorboard, mlflow] vs without (section 1b)")
    bl.add_common_args(parser)
    args = parser.parse_args()
    bl.configure(args)
    if args.trackers:
        trackers_on_vs_off(args)
        return

    work = bl.workdir("trainlift-bench-steps-")
    model = bl.prebuilt_model(work)
    log = work / "phases.jsonl"
    env = bl.clean_env(TRAINLIFT_HOME=str(work / "home"), PYTHONPATH=str(bl.REPO / "bench" / "phasetrace"),
                       BENCH_PHASE_LOG=str(log))
    spec_args = ["--set", f"model.path={model}"]

    pairs, loads = [], []
    for n in range(args.pairs):
        loads.append(bl.wait_for_quiet())
        a = bl.trainlift_train(["--steps", str(args.steps), *spec_args], work / "runs", f"steps-{n}", env,
                               sample_memory=True)
        loads.append(bl.wait_for_quiet())
        b = bl.torchrun_loop(spec_args, env, args.steps, args.warmup, sample_memory=True)
        a_periods, a_inside = trainlift_periods(a, args.warmup)
        a_window = (a["steps"][args.warmup]["time"], a["steps"][-1]["time"])
        pairs.append({"a": bl.median(a_periods), "a_inside": bl.median(a_inside), "b": b["result"]["median_step_s"],
                      "a_tok": a["summary"]["tokens_per_s"], "b_tok": b["result"]["tokens_per_s"],
                      "a_rss": a["peak_rss_mib"], "b_rss": b["peak_rss_mib"],
                      "a_cpu": a["sampler"].cpu_cores(*a_window),
                      "b_cpu": b["sampler"].cpu_cores(*b["result"]["steady_window"]),
                      "b_threads": b["result"]["workers"]})
        print(f"pair {n + 1}: trainlift {pairs[-1]['a'] * 1000:.1f} ms, torchrun {pairs[-1]['b'] * 1000:.1f} ms", flush=True)

    starts = [json.loads(line) for line in log.read_text().splitlines() if '"train_loop start"' in line]
    a_threads = sorted({(t["torch_threads"], t["omp_num_threads"]) for t in starts})
    b_threads = sorted({(w["torch_threads"], w["omp_num_threads"]) for p in pairs for w in p["b_threads"]})
    a_med, b_med = bl.median([p["a"] for p in pairs]), bl.median([p["b"] for p in pairs])
    ratio = a_med / b_med
    rows = [[n + 1, f"{p['a'] * 1000:.1f}", f"{p['a_inside'] * 1000:.1f}", f"{p['b'] * 1000:.1f}", f"{p['a'] / p['b']:.3f}",
             f"{p['a_tok']:.0f}", f"{p['b_tok']:.0f}"] for n, p in enumerate(pairs)]
    rows.append(["median", f"{a_med * 1000:.1f}", f"{bl.median([p['a_inside'] for p in pairs]) * 1000:.1f}",
                 f"{b_med * 1000:.1f}", f"{ratio:.3f}", "", ""])
    body = [
        f"Demo config (seq_len 128, micro-batch 8 per worker, grad_accum 1), 2 workers, {args.steps} steps per run, "
        f"median over steps {args.warmup + 2}–{args.steps}, pairs run A then B. Threads per worker, as the workers "
        f"reported them (torch.get_num_threads(), OMP_NUM_THREADS): trainlift {fmt_threads(a_threads)}, torchrun "
        f"{fmt_threads(b_threads)} — Ray sets "
        "OMP_NUM_THREADS=1 for a 1-CPU worker and torchrun sets it to 1 when it launches more than one process; "
        "neither was set by hand.\n",
        bl.table(["pair", "(a) trainlift ms/step", "(a) inside train_step ms", "(b) torchrun ms/step", "(a)/(b)",
                  "(a) tokens/s", "(b) tokens/s"], rows),
        f"\n**Ratio (a)/(b) = {ratio:.3f}** (target ≤ {TARGET}): **{'met' if ratio <= TARGET else 'missed'}**. "
        "\"Inside train_step\" is trainlift's own `step_time_s` (batch building through optimizer step); the rest "
        "of (a) is the per-step metrics row, progress update and stop-request poll.\n",
        "CPU used during the timed steps, in cores (CPU-seconds per second, median over pairs) by each kind of "
        "process the run started; the machine has 2:\n",
        bl.table(["process", "(a) trainlift run", "(b) torchrun run"], cpu_rows(pairs)),
    ]
    bl.record("1. Step overhead", loads, "\n".join(body), key="step_overhead")

    import_env = bl.clean_env(OMP_NUM_THREADS="1")
    imports = [[name, f"{import_rss_mib(code, import_env):.0f}"] for name, code in IMPORT_PROBES.items()]
    a_rss = [r for p in pairs for r in p["a_rss"]]
    b_rss = [r for p in pairs for r in p["b_rss"]]
    mem_ratio = bl.median(a_rss) / bl.median(b_rss)
    mem_rows = [[n + 1, ", ".join(f"{r:.0f}" for r in p["a_rss"]), ", ".join(f"{r:.0f}" for r in p["b_rss"])]
                for n, p in enumerate(pairs)]
    mem_rows.append(["median", f"{bl.median(a_rss):.0f}", f"{bl.median(b_rss):.0f}"])
    a_start = [t["rss_mib"] for t in starts]
    b_start = [w["rss_before_data_mib"] for p in pairs for w in p["b_threads"]]
    mem_body = [
        "Peak resident set (VmHWM, MiB) of each training worker process, sampled every 0.5 s in the runs of "
        "benchmark 1 (trainlift: the two `RayTrainWorker` actors; torchrun: its two worker processes). "
        "trainlift's workers also run the initial and final evaluation, the DCP checkpoint and (rank 0) the export.\n",
        bl.table(["pair", "trainlift workers MiB", "torchrun workers MiB"], mem_rows),
        f"\n**trainlift / torchrun = {mem_ratio:.2f}** per worker (no numeric target). Before any data or model is "
        f"loaded (trainlift: entering the train loop; torchrun: after the process group) a worker already holds "
        f"{bl.median(a_start):.0f} MiB (trainlift) against {bl.median(b_start):.0f} MiB (torchrun), a "
        f"{bl.median(a_start) - bl.median(b_start):.0f} MiB gap, against "
        f"{bl.median(a_rss) - bl.median(b_rss):.0f} MiB between the peaks.\n",
        "Peak RSS of a fresh interpreter that only imports each side's modules:\n",
        bl.table(["imports", "MiB"], imports),
    ]
    bl.record("6. Memory per worker", loads, "\n".join(mem_body), key="step_overhead_memory")


if __name__ == "__main__":
    main()
