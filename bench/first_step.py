"""Benchmark 2: time from process start to the first optimizer step.

    python bench/first_step.py [--pairs 3] [--steps 3] [--no-record]

Three contenders on the demo config, in rotating order per round: `trainlift train` cold (it starts
Ray), `trainlift train` warm (a `trainlift local up` head is already running) and the torchrun loop.
The clock starts just before the process is launched and stops at the end of the first optimizer step
(the `time` of step 1 in metrics.jsonl; the torchrun loop's first step end). Every process runs with
bench/phasetrace on PYTHONPATH, which timestamps imports and trainlift's start-up calls in the driver
and in every Ray worker, so each run comes with its own per-phase evidence.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import benchlib as bl

TARGET_WARM, TARGET_COLD = 1.5, 2.0  # × torchrun
TARGET_DRIVER_S = 1.5  # the driver's own share, warm (torchrun's agent: 1.4-2.1 s on the 2-core machine)
TARGET_RECIPE_IMPORT_S = 0.5  # a worker's import of the recipe, on top of the torch and Ray Train it has already
DRIVER_PHASES = (0, 1, 3)  # CLI start-up and the driver's work before fit(), not Ray's own start

TRAINLIFT_PHASES = [
    ("CLI start-up: interpreter, typer, trainlift imports", None, "run_training start"),
    ("driver: import ray, preflight checks", "run_training start", "ensure_ray start"),
    ("driver: start Ray (cold) or attach to the head (warm)", "ensure_ray start", "ensure_ray end"),
    ("driver: model check, data cache check, progress-board actor, trainer", "ensure_ray end", "fit start"),
    ("Ray Train: controller + worker actors start, imports, gloo group", "fit start", "train_loop start"),
    ("worker: doctor stack check", "train_loop start", "check_stack end"),
    ("worker: tokenizer + map the data cache (train and eval)", "check_stack end", "build_model start"),
    ("worker: build the model (meta init, FSDP2 wrap, fill the shards)", "build_model start", "build_model end"),
    ("worker: optimizer, resume check, barrier, metrics sink", "build_model end", "evaluate start"),
    ("worker: initial evaluation (step 0 eval_loss)", "evaluate start", "evaluate end"),
    ("worker: first step (batch, forward, backward, optimizer)", "step_batches start", "first step"),
]
TORCHRUN_PHASES = [
    ("torchrun agent start-up until the workers are spawned", None, "worker created"),
    ("worker: interpreter, torch, transformers, trainlift imports", "worker created", "imports_done"),
    ("worker: gloo process group", "imports_done", "process_group"),
    ("worker: tokenizer", "process_group", "tokenizer"),
    ("worker: data prepare (train only)", "tokenizer", "data_prepare"),
    ("worker: load model (from_pretrained)", "data_prepare", "model_load"),
    ("worker: FSDP2 wrap + optimizer", "model_load", "fsdp"),
    ("worker: first step (batch, forward, backward, optimizer)", "fsdp", "first_step"),
]


def events_between(log: Path, start: float, end: float) -> list[dict]:
    if not log.exists():
        return []
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [r for r in rows if start <= r["t"] <= end]


def actor_names(pids: set[int]) -> dict[int, str]:
    """Ray names each worker process's log after its pid; the first line names the actor it hosts."""
    names = {}
    for pid in pids:
        for path in glob.glob(os.path.join(tempfile.gettempdir(), "ray", "session_*", "logs", f"worker-*-{pid}.out")):
            with open(path, errors="replace") as fh:
                head = fh.read(400)
            if ":actor_name:" in head:
                names[pid] = head.split(":actor_name:", 1)[1].split()[0]
    return names


def trainlift_marks(events: list[dict], first_step_t: float) -> tuple[dict, list[dict]]:
    """Driver marks from the CLI process, worker marks as the latest over the training workers."""
    train_pids = {e["pid"] for e in events if e["event"] == "train_loop start"}
    driver_pid = next(e["pid"] for e in events if e["event"] == "run_training start")
    marks: dict[str, float] = {"first step": first_step_t}
    for e in events:
        if e.get("call", 1) != 1:
            continue
        if e["pid"] == driver_pid and e["event"] not in marks:
            marks[e["event"]] = e["t"]
        elif e["pid"] in train_pids:
            marks[e["event"]] = max(marks.get(e["event"], 0.0), e["t"])
    fit = marks.get("fit start", 0.0)
    started = [e for e in events if e["event"] == "process created" and e["role"] in ("default_worker.py", "setup_worker.py")
               and e["at"] >= fit]
    names = actor_names({e["pid"] for e in started})
    processes = []
    for e in sorted(started, key=lambda e: e["at"]):
        if e["role"] != "default_worker.py":
            continue
        imports = {x["event"]: x["t"] for x in events if x["pid"] == e["pid"] and x["event"].startswith("import ")}
        processes.append({"pid": e["pid"], "actor": names.get(e["pid"], "?"), "created": e["at"] - fit,
                          "ray_imported": imports.get("import ray", e["at"]) - fit,
                          "torch_imported": imports["import torch"] - fit if "import torch" in imports else None})
    return marks, processes


def torchrun_marks(result: dict, events: list[dict], t0: float) -> dict:
    marks = {k: v + t0 for k, v in result["phases"].items()}
    created = [e["at"] for e in events if e["event"] == "process created" and e["role"] == "torchrun_fsdp.py"]
    marks["worker created"] = max(created) if created else t0
    return marks


def durations(marks: dict, phases, t0: float) -> list[float | None]:
    out = []
    for _, start, end in phases:
        a = t0 if start is None else marks.get(start)
        b = marks.get(end)
        out.append(None if a is None or b is None else b - a)
    return out


def run_trainlift(mode: str, env: dict, run_dir: Path, n: int, model: str, steps: int, log: Path) -> dict:
    out = bl.trainlift_train(["--steps", str(steps), "--set", f"model.path={model}"], run_dir, f"{mode}-{n}", env)
    first = next(r for r in out["steps"] if r["step"] == 1)["time"]
    events = events_between(log, out["t0"], first + 0.001)
    marks, processes = trainlift_marks(events, first)
    worker = next(e for e in events if e["event"] == "train_loop start")
    return {"ttfs": first - out["t0"], "phases": durations(marks, TRAINLIFT_PHASES, out["t0"]),
            "processes": processes, "threads": (worker["torch_threads"], worker["omp_num_threads"])}


def run_torchrun(env: dict, model: str, log: Path) -> dict:
    out = bl.torchrun_loop(["--set", f"model.path={model}"], env, steps=3, warmup=0)
    result = out["result"]
    events = events_between(log, out["t0"], out["t0"] + result["time_to_first_step_s"])
    marks = torchrun_marks(result, events, out["t0"])
    return {"ttfs": result["time_to_first_step_s"], "phases": durations(marks, TORCHRUN_PHASES, out["t0"]),
            "threads": (result["workers"][0]["torch_threads"], result["workers"][0]["omp_num_threads"])}


def local_head(action: str, env: dict, port: int) -> None:
    cmd = [str(bl.BIN / "trainlift"), "local", action] + (["--port", str(port)] if action == "up" else [])
    out = subprocess.run(cmd, cwd=bl.REPO, env=env, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"trainlift local {action} failed: {out.stderr[-2000:]}")


def recipe_import_profile(env: dict) -> tuple[float, list[tuple[str, float]]]:
    """`python -X importtime` of `import trainlift.train.recipe` in an interpreter that already has torch and
    ray.train.torch, as a Ray Train worker has when it unpickles the train function."""
    code = ("import sys, time, torch, ray.train.torch\nsys.stderr.write('RECIPE\\n')\nt = time.perf_counter()\n"
            "import trainlift.train.recipe\nprint(time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    rows = []
    for line in out.stderr.split("RECIPE\n", 1)[1].splitlines():
        match = re.match(r"import time:\s+\d+ \|\s+(\d+) \|( +)(\S+)", line)
        if match and len(match[2]) <= 5 and int(match[1]) >= 20_000:
            rows.append(("· " * (len(match[2]) // 2) + f"`{match[3]}`", int(match[1]) / 1e6))
    return float(out.stdout.strip()), rows[::-1]


def prebuilt_data_cache(storage: Path, model: str) -> None:
    """The demo data tokenized into the data cache under `storage` once, as the first run on a dataset does: the
    measured runs (cold means Ray starts, not the first run ever) find it. The torchrun loop tokenizes in each
    of its runs (its "data prepare" phase)."""
    from trainlift.config.job import load_job_spec
    from trainlift.train import launch
    from trainlift.train.run import preflight

    spec = load_job_spec(bl.REPO / bl.DEMO_SPEC, [f"model.path={model}", f"run.storage={storage}"])
    launch.prepare_data(preflight.resolve_paths(spec))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def med(values):
    values = [v for v in values if v is not None]
    return bl.median(values) if values else None


def fmt(value, spec=".2f"):
    return "—" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3, help="rounds of cold, warm and torchrun runs")
    parser.add_argument("--steps", type=int, default=3, help="steps per trainlift run (only the first is timed)")
    bl.add_common_args(parser)
    args = parser.parse_args()
    bl.configure(args)

    work = bl.workdir("trainlift-bench-ttfs-")
    model = bl.prebuilt_model(work)
    prebuilt_data_cache(work / "runs", model)
    log = work / "phases.jsonl"
    trace = {"PYTHONPATH": str(bl.REPO / "bench" / "phasetrace"), "BENCH_PHASE_LOG": str(log)}
    cold_env = bl.clean_env(TRAINLIFT_HOME=str(work / "home-cold"), **trace)
    # `trainlift train` finds the head `trainlift local up` recorded in TRAINLIFT_HOME and attaches with its token.
    warm_env = bl.clean_env(TRAINLIFT_HOME=str(work / "home-warm"), **trace)
    port = free_port()

    results, loads, up_times = defaultdict(list), [], []
    order = ["torchrun", "cold", "warm"]
    for n in range(args.pairs):
        for mode in order:
            if mode == "warm":
                started = time.time()
                local_head("up", warm_env, port)
                up_times.append(time.time() - started)
            loads.append(bl.wait_for_quiet())
            try:
                if mode == "torchrun":
                    results[mode].append(run_torchrun(cold_env, model, log))
                else:
                    env = warm_env if mode == "warm" else cold_env
                    results[mode].append(run_trainlift(mode, env, work / "runs", n, model, args.steps, log))
            finally:
                if mode == "warm":
                    local_head("down", warm_env, port)
            print(f"round {n + 1} {mode}: {results[mode][-1]['ttfs']:.2f} s", flush=True)
        order.reverse()

    loads.append(bl.wait_for_quiet())
    recipe_s, recipe_rows = recipe_import_profile(bl.clean_env(OMP_NUM_THREADS="1"))
    ttfs = {mode: med([r["ttfs"] for r in runs]) for mode, runs in results.items()}
    ratio_warm, ratio_cold = ttfs["warm"] / ttfs["torchrun"], ttfs["cold"] / ttfs["torchrun"]
    verdict = {mode: "met" if ratio <= target else "missed"
               for mode, ratio, target in (("warm", ratio_warm, TARGET_WARM), ("cold", ratio_cold, TARGET_COLD))}
    rows = [[mode, fmt(ttfs[mode]), " ".join(fmt(r["ttfs"], ".1f") for r in results[mode]),
             fmt(ttfs[mode] / ttfs["torchrun"]), "{} (OMP_NUM_THREADS={})".format(*results[mode][0]["threads"])]
            for mode in ("torchrun", "cold", "warm")]
    body = [f"Time from launching the command to the end of the first optimizer step, demo config, 2 workers, "
            f"{args.pairs} rounds (order rotated each round). The model and the data cache were built before the "
            f"rounds, as a first run on them builds them. The warm head was started with `trainlift local up` "
            f"before each warm run (median {fmt(med(up_times), '.1f')} s, not counted) and stopped after it.\n",
            bl.table(["runner", "median s", "runs s", "× torchrun", "torch threads per worker"], rows),
            f"\n**Warm / torchrun = {ratio_warm:.2f}** (target ≤ {TARGET_WARM}): **{verdict['warm']}**. "
            f"**Cold / torchrun = {ratio_cold:.2f}** (target ≤ {TARGET_COLD}): **{verdict['cold']}**.\n",
            driver_share_line(results),
            "Median seconds per phase (worker phases: the later of the two workers; phases in order, "
            "so they add up to the total):\n",
            bl.table(["trainlift phase", "cold s", "warm s"],
                     [[name, fmt(med([r["phases"][i] for r in results["cold"]])),
                       fmt(med([r["phases"][i] for r in results["warm"]]))]
                      for i, (name, _, _) in enumerate(TRAINLIFT_PHASES)]),
            "",
            bl.table(["torchrun phase", "s"],
                     [[name, fmt(med([r["phases"][i] for r in results["torchrun"]]))]
                      for i, (name, _, _) in enumerate(TORCHRUN_PHASES)]),
            "\nPython processes Ray starts after `fit()` in the last warm run (seconds after `fit()` began):\n",
            bl.table(["actor", "created s", "`import ray` done s", "`import torch` done s"],
                     [[p["actor"], fmt(p["created"]), fmt(p["ray_imported"]), fmt(p["torch_imported"])]
                      for p in results["warm"][-1]["processes"]]),
            f"\nImporting `trainlift.train.recipe` (what a worker does when it unpickles the train function, after "
            f"torch and ray.train.torch are in) takes {recipe_s:.2f} s in a quiet interpreter (target ≤ "
            f"{TARGET_RECIPE_IMPORT_S} s): **{'met' if recipe_s <= TARGET_RECIPE_IMPORT_S else 'missed'}**; the "
            "modules behind it (`python -X importtime`, cumulative, ≥ 20 ms):\n",
            bl.table(["module (nesting)", "cumulative s"], [[name, f"{sec:.2f}"] for name, sec in recipe_rows])]
    bl.record("2. Time to first step", loads, "\n".join(body), key="first_step")


def driver_share_line(results: dict) -> str:
    """What trainlift's own driver costs before `fit()` (phases 1, 2 and 4 below), against torchrun's agent."""
    med = bl.median
    share = {mode: med([sum(r["phases"][i] for i in DRIVER_PHASES) for r in results[mode]]) for mode in ("cold", "warm")}
    agent = med([r["phases"][0] for r in results["torchrun"]])
    verdict = "met" if share["warm"] <= TARGET_DRIVER_S else "missed"
    return (f"**Driver's share** (CLI start-up and the driver's work before `fit()`, Ray's own start excluded): "
            f"warm {share['warm']:.2f} s, cold {share['cold']:.2f} s, against torchrun's agent {agent:.2f} s "
            f"(target warm ≤ {TARGET_DRIVER_S} s): **{verdict}**.\n")


if __name__ == "__main__":
    main()
