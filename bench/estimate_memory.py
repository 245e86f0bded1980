"""Benchmark 15: peak host memory per training worker, measured, against what `trainlift estimate` predicts.

    python bench/estimate_memory.py [--configs A,B,C,D] [--allocators default,fixed] [--steps 4] [--no-record]

A ~134M-parameter Llama (hidden 768, 12 layers, vocabulary 32,000, untied; saved as bf16 safetensors, trained
in fp32) on the demo data, micro-batch 2, CPU workers (gloo), in four configurations:

  A  full fine-tuning, 2 workers        B  A + model.activation_checkpointing
  C  A + LoRA (r 16, all linear layers) D  A on 4 workers

Each configuration is one spec file, given as it is to `trainlift estimate SPEC --json` (the prediction: host
memory per worker, fp32, its `runtime_gib` included in `total`) and to `trainlift train SPEC --stop-at-step N`
(the measurement). `train.steps` is larger than N, so the run stops after step N without the final evaluation
and HF export; the DCP checkpoint that --stop-at-step writes after step N is the one phase past the steps.
Every worker process's VmHWM and VmRSS are sampled from outside every 0.25 s, and bench/phasetrace
timestamps the worker's phases (its resident memory on entering the train loop, before data and model: the
runtime constant), so the time at which each worker reached its peak names the phase it belongs to.

Each configuration runs twice: with glibc's malloc as it comes (`default`), and with its mmap threshold fixed at
128 KiB (`fixed`: MALLOC_MMAP_THRESHOLD_=131072 in the environment of `trainlift train`, which its Ray workers
inherit). glibc's dynamic threshold rises each time a large block is freed, so later tensors of that size come
from the heap, which keeps what they free; fixed, every tensor of 128 KiB or more is its own mapping, returned to
the system when freed, so the peak is that of the memory in use (and every such tensor costs fresh pages).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

import benchlib as bl
from model_memory import build_model

TARGET = (0.8, 1.2)
MIB_PER_GIB = 1024
CLOSE_TO_PEAK = 0.99  # the phase of a peak: where VmHWM first reached this fraction of it
CONFIGS = {
    "A": ("full fine-tuning", {}),
    "B": ("A + activation checkpointing", {"model": {"activation_checkpointing": True}}),
    "C": ("A + LoRA r 16", {"model": {"lora": {"r": 16}}}),
    "D": ("A on 4 workers", {"scaling": {"workers": 4}}),
}
ALLOCATORS = {
    "default": ("glibc malloc as it comes", {}),
    "fixed": ("MALLOC_MMAP_THRESHOLD_=131072", {"MALLOC_MMAP_THRESHOLD_": "131072"}),
}


def merged(base: dict, extra: dict) -> dict:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for section, fields in extra.items():
        out.setdefault(section, {}).update(fields)
    return out


def write_specs(work: Path, model_dir: str, args) -> dict[str, Path]:
    """One self-contained spec file per configuration: estimate and train read the very same file."""
    base = {
        "model": {"path": model_dir, "tokenizer": str(bl.REPO / "examples" / "tiny" / "tokenizer")},
        "data": {"train": str(bl.REPO / "examples" / "data" / "tasks-train.jsonl"),
                 "eval": str(bl.REPO / "examples" / "data" / "tasks-eval.jsonl"),
                 "format": "messages", "seq_len": args.seq_len, "eval_examples": 8},
        "train": {"steps": args.steps + 100, "micro_batch_size": args.micro_batch, "grad_accum": 1,
                  "warmup_steps": 0, "eval_every": 0},
        "scaling": {"workers": 2},
        "checkpoint": {"every_steps": 0, "keep": 1},
        "run": {"storage": str(work / "runs")},
    }
    specs = {}
    for key in args.configs:
        spec = merged(base, CONFIGS[key][1])
        spec["run"]["name"] = f"estimate-{key}"
        specs[key] = work / f"spec-{key}.yaml"
        specs[key].write_text(yaml.safe_dump(spec, sort_keys=False))
    return specs


def estimate(spec: Path) -> dict | None:
    """`trainlift estimate SPEC --json`; None (and why, on stderr) when the command fails or does not exist."""
    cmd = [str(bl.BIN / "trainlift"), "estimate", str(spec), "--json"]
    proc = subprocess.run(cmd, cwd=bl.REPO, env=bl.clean_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"trainlift estimate failed ({proc.returncode}): {proc.stderr.strip()[-600:]}", file=sys.stderr)
        return None
    out = proc.stdout
    return json.loads(out[out.index("{"):])


def prediction_mib(est: dict) -> dict:
    """The estimate's per-worker items, its total and its runtime constant, in MiB."""
    items = {k: v * MIB_PER_GIB for k, v in est["per_gpu_gib"].items() if isinstance(v, (int, float))}
    return {"total": items.pop("total"), "runtime": est["runtime_gib"] * MIB_PER_GIB, "items": items}


class Timeline:
    """A `select` for benchlib's RssSampler: picks the Ray Train workers and keeps every sample of their
    (time, VmHWM, VmRSS) in KiB, so the moment each reached its peak can be set against the run's phases."""

    def __init__(self):
        self.samples: dict[int, list[tuple[float, int, int]]] = {}

    def __call__(self, proc, _root) -> bool:
        if not " ".join(proc.cmdline()).startswith("ray::RayTrainWorker"):
            return False
        fields = {}
        with open(f"/proc/{proc.pid}/status") as fh:
            for line in fh:
                if line.startswith(("VmHWM:", "VmRSS:")):
                    fields[line.split(":")[0]] = int(line.split()[1])
        if len(fields) < 2:  # a process that is exiting has no memory figures left
            return False
        self.samples.setdefault(proc.pid, []).append((time.time(), fields["VmHWM"], fields["VmRSS"]))
        return True


def train(spec: Path, stop_at: int, work: Path, key: str, allocator: str) -> dict:
    """`trainlift train SPEC --stop-at-step N --json` (exit 3: stopped at a checkpoint), sampled from outside."""
    log = work / f"phases-{key}-{allocator}.jsonl"
    log.unlink(missing_ok=True)
    shutil.rmtree(work / "runs" / f"estimate-{key}", ignore_errors=True)  # a run left there would be resumed
    env = bl.clean_env(TRAINLIFT_HOME=str(work / "home"), PYTHONPATH=str(bl.REPO / "bench" / "phasetrace"),
                       BENCH_PHASE_LOG=str(log), **ALLOCATORS[allocator][1])
    cmd = [str(bl.BIN / "trainlift"), "train", str(spec), "--stop-at-step", str(stop_at), "--json"]
    timeline = Timeline()
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=bl.REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = bl.RssSampler(proc.pid, timeline, interval_s=0.25)
    sampler.start()
    out, err = proc.communicate(timeout=3600)
    sampler.stop()
    if proc.returncode != 3:
        raise RuntimeError(f"trainlift train {key} ended with {proc.returncode}, not 3 (stopped): {err[-3000:]}")
    summary = json.loads(out[out.index("{"):])
    rows = [json.loads(line) for line in (Path(summary["run"]) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r and "step" in r and "eval_loss" not in r]
    events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
    return {"t0": t0, "summary": summary, "steps": steps, "events": events, "timeline": timeline.samples,
            "wall_s": time.time() - t0}


def phases(run: dict, pid: int) -> list[tuple[float, str]]:
    """(start time, name) of each phase of worker `pid`, in order: its own phasetrace marks, then the step ends
    rank 0 logged (every worker ends a step within the same collectives)."""
    mine = {}
    for e in run["events"]:
        if e["pid"] == pid and e["event"] not in mine:
            mine[e["event"]] = e["t"]
    marks = [(run["t0"], "start-up (before the train loop)"),
             (mine.get("train_loop start"), "train loop entry: doctor check, tokenizer, data"),
             (mine.get("build_model start"), "model build and load"),
             (mine.get("build_model end"), "optimizer, resume check, barrier"),
             (mine.get("evaluate start"), "initial evaluation"),
             (mine.get("evaluate end"), "step 1")]
    times = [r["time"] for r in run["steps"]]
    marks += [(t, f"step {n + 2}") for n, t in enumerate(times[:-1])]
    if times:
        marks.append((times[-1], f"after step {len(times)}: DCP checkpoint (--stop-at-step), shutdown"))
    return [(t, name) for t, name in marks if t is not None]


def phase_at(marks: list[tuple[float, str]], t: float) -> str:
    name = marks[0][1]
    for start, label in marks:
        if start <= t:
            name = label
    return name


def worker_figures(run: dict) -> list[dict]:
    """Per worker: loop-entry RSS, peak, the phase in which the peak was reached (between the last sample below
    99% of it and the first at or above), the peak up to the end of the last step (before the checkpoint) and
    what the worker still held then."""
    entry = {e["pid"]: e["rss_mib"] for e in run["events"] if e["event"] == "train_loop start"}
    last_step = run["steps"][-1]["time"] if run["steps"] else float("inf")
    out = []
    for pid, samples in run["timeline"].items():
        peak = max(hwm for _, hwm, _ in samples)
        reached = next(i for i, (_, hwm, _) in enumerate(samples) if hwm >= CLOSE_TO_PEAK * peak)
        after = samples[reached][0]
        before = samples[reached - 1][0] if reached else run["t0"]
        marks = phases(run, pid)
        phase_a, phase_b = phase_at(marks, before), phase_at(marks, after)
        through_steps = max((hwm for t, hwm, _ in samples if t <= last_step), default=0)
        held = next((rss for t, _, rss in reversed(samples) if t <= last_step), 0)
        out.append({"pid": pid, "entry_mib": entry.get(pid), "peak_mib": peak / 1024,
                    "steps_peak_mib": through_steps / 1024, "held_mib": held / 1024,
                    "phase": phase_a if phase_a == phase_b else f"{phase_a} / {phase_b}",
                    "peak_window_s": (before - run["t0"], after - run["t0"])})
    return sorted(out, key=lambda w: -w["peak_mib"])


def print_phases(label: str, run: dict) -> None:
    """VmHWM and VmRSS (MiB) of each worker at the start of each phase, on stderr: where the memory came in."""
    for pid, samples in sorted(run["timeline"].items()):
        cells = []
        for start, name in phases(run, pid):
            seen = [(hwm, rss) for t, hwm, rss in samples if t <= start]
            if seen:
                cells.append(f"{name}: hwm {seen[-1][0] / 1024:.0f} rss {seen[-1][1] / 1024:.0f}")
        end_hwm, end_rss = samples[-1][1] / 1024, samples[-1][2] / 1024
        print(f"{label} worker {pid}: " + "; ".join(cells) + f"; last sample: hwm {end_hwm:.0f} rss {end_rss:.0f}",
              file=sys.stderr)


def measure(key: str, allocator: str, spec: Path, args, work: Path) -> dict:
    run = train(spec, args.steps, work, key, allocator)
    workers = worker_figures(run)
    print_phases(f"{key} {allocator}", run)
    step_times = [r["step_time_s"] for r in run["steps"]]
    print(f"{key} {allocator}: peaks {[round(w['peak_mib']) for w in workers]} MiB, entry "
          f"{[round(w['entry_mib'] or 0) for w in workers]} MiB, peak phase {workers[0]['phase']!r}, "
          f"step times {[round(s, 1) for s in step_times]} s, wall {run['wall_s']:.0f} s", flush=True)
    return {"workers": workers, "step_times": step_times}


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "—"


def result_rows(runs: list[tuple[str, str]], measured: dict, predicted: dict) -> list[list]:
    rows = []
    for key, allocator in runs:
        m, p = measured[key, allocator], predicted.get(key)
        top = m["workers"][0]
        each = ", ".join(f"{w['peak_mib']:,.0f}" for w in m["workers"])
        above = top["peak_mib"] - (top["entry_mib"] or 0)
        label = f"{key}: {CONFIGS[key][0]}" + ("" if allocator == "default" else f"; {ALLOCATORS[allocator][0]}")
        if p is None:
            rows.append([label, len(m["workers"]), "—", f"{top['peak_mib']:,.0f} ({each})", "—", "—",
                         f"{above:,.0f}", "—"])
            continue
        p_above = p["total"] - p["runtime"]
        rows.append([label, len(m["workers"]), f"{p['total']:,.0f}", f"{top['peak_mib']:,.0f} ({each})",
                     f"**{ratio(top['peak_mib'], p['total'])}**", f"{p_above:,.0f}", f"{above:,.0f}",
                     ratio(above, p_above)])
    return rows


def step_time_line(keys: list[str], measured: dict) -> str:
    """The fixed threshold's price: median step time fixed / default, where both ran."""
    ratios = [f"{k} {bl.median(measured[k, 'fixed']['step_times']) / bl.median(measured[k, 'default']['step_times']):.2f}"
              for k in keys if (k, "fixed") in measured and (k, "default") in measured]
    return f"Median step time, fixed / default (same load caveats as the rest): {', '.join(ratios)}.\n" if ratios else ""


def detail_rows(runs: list[tuple[str, str]], measured: dict) -> list[list]:
    rows = []
    for key, allocator in runs:
        m = measured[key, allocator]
        for w in m["workers"]:
            lo, hi = w["peak_window_s"]
            rows.append([key, allocator, f"{w['entry_mib']:,.0f}" if w["entry_mib"] else "—", f"{w['peak_mib']:,.0f}",
                         f"{w['steps_peak_mib']:,.0f}", f"{w['held_mib']:,.0f}", w["phase"], f"{lo:.1f}–{hi:.1f}",
                         f"{bl.median(m['step_times']):.1f}"])
    return rows


def item_rows(keys: list[str], predicted: dict) -> list[list]:
    names = []
    for key in keys:
        for name in predicted.get(key, {}).get("items", {}):
            if name not in names:
                names.append(name)
    rows = [[f"`{name}`", *(f"{predicted[k]['items'][name]:,.0f}" if name in predicted.get(k, {}).get("items", {})
                            else "—" for k in keys)] for name in names]
    rows.append(["**total**", *(f"{predicted[k]['total']:,.0f}" if k in predicted else "—" for k in keys)])
    return rows


def dominant(key: str, p: dict | None, measured: dict) -> str:
    """What the prediction says dominates `key` above the runtime constant, and, where both allocators ran, how
    much of the measured peak glibc's heap kept beyond the memory in use."""
    if p is None:
        return f"{key}: no prediction."
    rest = {k: v for k, v in p["items"].items() if k != "runtime"}
    name, value = max(rest.items(), key=lambda kv: kv[1])
    above = p["total"] - p["runtime"]
    text = (f"{key} ({CONFIGS[key][0]}): `{name}` dominates the prediction above the runtime constant "
            f"({value:,.0f} of {above:,.0f} MiB, {value / above:.0%})")
    if (key, "default") in measured and (key, "fixed") in measured:
        kept = measured[key, "default"]["workers"][0]["peak_mib"] - measured[key, "fixed"]["workers"][0]["peak_mib"]
        text += f"; measured, {kept:,.0f} MiB of the peak is heap glibc kept (peak as it comes − peak fixed)"
    return text + "."


def verdict(runs: list[tuple[str, str]], measured: dict, predicted: dict, allocator: str) -> str:
    ratios = {k: measured[k, a]["workers"][0]["peak_mib"] / predicted[k]["total"]
              for k, a in runs if a == allocator and k in predicted}
    if not ratios:
        return ""
    inside = sum(TARGET[0] <= r <= TARGET[1] for r in ratios.values())
    word = "met" if inside == len(ratios) else f"missed in {len(ratios) - inside} of {len(ratios)}"
    return (f"{ALLOCATORS[allocator][0]}: **{word}** ({', '.join(f'{k} {r:.2f}' for k, r in ratios.items())})")


def body_text(runs: list[tuple[str, str]], measured: dict, predicted: dict, args) -> str:
    keys = list(dict.fromkeys(k for k, _ in runs))
    verdicts = [v for a in ALLOCATORS if (v := verdict(runs, measured, predicted, a))]
    parts = [
        f"Llama architecture, 134M parameters (hidden 768, 12 layers, vocabulary 32,000, untied), saved as bf16 "
        f"safetensors and trained in fp32 on CPU workers (gloo, one thread each), micro-batch {args.micro_batch} × "
        f"seq_len {args.seq_len} packed rows of the demo data, grad_accum 1, 8 eval examples; each run stops after "
        f"step {args.steps} (`--stop-at-step`: a DCP checkpoint, no final evaluation or export). Predicted: "
        "`trainlift estimate SPEC --json`, `per_gpu_gib.total` (host memory per worker: a local CPU run, fp32), on "
        "the same spec file. Measured: each `RayTrainWorker` process's VmHWM, sampled from outside every 0.25 s. "
        "The constant is the runtime: the estimate's `runtime_gib`; measured, the worker's resident memory on "
        "entering the train loop, before data and model (bench/phasetrace). Each configuration ran with glibc's "
        "malloc as it comes (what a user gets) and with `MALLOC_MMAP_THRESHOLD_=131072` in the environment of "
        "`trainlift train` (its workers inherit it): every tensor of 128 KiB or more is then returned to the system "
        "when freed, so the peak is that of the memory in use, at the cost of fresh pages for every such tensor "
        "(the step times below).\n",
        bl.table(["config", "workers", "predicted per worker MiB (total)", "measured peak per worker MiB (max; each)",
                  "measured / predicted", "predicted above the constant MiB", "measured above the constant MiB",
                  "ratio of those"], result_rows(runs, measured, predicted)),
        f"\n**Measured / predicted within {TARGET[0]}–{TARGET[1]} (±20%)**: "
        + "; ".join(verdicts or ["not judged: no prediction"]) + ".\n",
        step_time_line(keys, measured),
        "Per worker: resident memory on entering the train loop, the peak, the peak up to the end of the last "
        "step (before the checkpoint), what it still held then (VmRSS, the last sample before that step's end), "
        f"the phase in which VmHWM reached {CLOSE_TO_PEAK:.0%} of its peak (the two samples around it, seconds "
        "from launch; \"step k\" runs from the end of step k−1 to the end of step k) and the run's median step "
        "time:\n",
        bl.table(["config", "malloc", "loop entry MiB", "peak MiB", "peak through the steps MiB",
                  "resident at the last step's end MiB", "phase of the peak", "peak reached between s",
                  "step s"], detail_rows(runs, measured)),
        "\nThe prediction item by item (MiB per worker):\n",
        bl.table(["item", *keys], item_rows(keys, predicted)),
        "\n" + " ".join(dominant(k, predicted.get(k), measured) for k in keys),
    ]
    return "\n".join(parts)


def parse_list(parser, text: str, known: dict, upper: bool) -> list[str]:
    picked = [c.strip().upper() if upper else c.strip() for c in text.split(",") if c.strip()]
    if not picked or set(picked) - set(known):
        parser.error(f"{text!r}: pick from {', '.join(known)}")
    return picked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="A,B,C,D", help="comma-separated, of A, B, C, D")
    parser.add_argument("--allocators", default="default,fixed",
                        help="default (glibc malloc as it comes) and/or fixed (MALLOC_MMAP_THRESHOLD_=131072)")
    parser.add_argument("--steps", type=int, default=4, help="steps per run (then --stop-at-step stops it)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--workdir", default=None, help="where the model and specs go (default: a temp dir)")
    bl.add_common_args(parser)
    args = parser.parse_args()
    args.configs = parse_list(parser, args.configs, CONFIGS, upper=True)
    allocators = parse_list(parser, args.allocators, ALLOCATORS, upper=False)
    bl.configure(args)

    work = Path(args.workdir) if args.workdir else bl.workdir("trainlift-bench-estimate-")
    work.mkdir(parents=True, exist_ok=True)
    model_dir, _ = build_model(work)
    specs = write_specs(work, model_dir, args)
    predicted = {}
    for key, spec in specs.items():
        est = estimate(spec)
        if est is not None:
            predicted[key] = prediction_mib(est)
            print(f"{key} predicted: {json.dumps(est['per_gpu_gib'])}, runtime_gib {est['runtime_gib']}", flush=True)
    runs = [(key, allocator) for key in args.configs for allocator in allocators]
    measured, loads = {}, []
    for key, allocator in runs:
        loads.append(bl.wait_for_quiet())
        measured[key, allocator] = measure(key, allocator, specs[key], args, work)
    body = body_text(runs, measured, predicted, args)
    if len(predicted) < len(specs):
        print("\n(no prediction for every config: printed only, docs/BENCHMARKS.md left alone)\n" + body)
        return
    bl.record("15. Predicted against measured memory", loads, body, key="estimate_memory")


if __name__ == "__main__":
    main()
