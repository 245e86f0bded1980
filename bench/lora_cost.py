"""Benchmark 12: LoRA against full fine-tuning on the same model and batch: peak RSS per worker, step time and
checkpoint bytes.

    python bench/lora_cost.py [--steps 12] [--repeats 1] [--model demo|wide] [--no-record]

Both contenders are `trainlift train` runs of the demo spec (2 CPU workers, gloo) that differ only in
`model.lora` (r 16, all linear layers of the decoder blocks); they alternate (full, LoRA, full, ...) so that a
change in the machine's load hits both. `--model wide` widens the demo model (hidden 512, 8 layers), where
weights, gradients and AdamW state outweigh the fixed cost of a Python/torch/Ray process; `demo` is the demo
model itself. Step time: the median `step_time_s` of steps 3.. of each run. Checkpoint bytes: all files of
the run's last checkpoint. Peak RSS: VmHWM of each Ray Train worker process.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import benchlib as bl

LORA = ["--set", "model.lora.r=16", "--set", "model.lora.alpha=32"]
WIDE = ["--set", "model.config.hidden_size=512", "--set", "model.config.intermediate_size=1408",
        "--set", "model.config.num_hidden_layers=8", "--set", "model.config.num_attention_heads=8",
        "--set", "model.config.num_key_value_heads=2"]


def checkpoint_bytes(run_dir: Path) -> int:
    latest = sorted(run_dir.glob("checkpoint_0*"))[-1]
    return sum(f.stat().st_size for f in latest.rglob("*") if f.is_file())


def one_run(kind: str, common: list[str], work: Path, index: int, env: dict) -> dict:
    name = f"{kind}-{index}"
    run = bl.trainlift_train(common + (LORA if kind == "lora" else []), work / "runs", name, env, sample_memory=True)
    times = [r["step_time_s"] for r in run["steps"] if r["step"] >= 3]
    return {"peak_rss_mib": run["peak_rss_mib"], "step_time_s": bl.median(times),
            "checkpoint_bytes": checkpoint_bytes(work / "runs" / name),
            "trainable": run["summary"].get("trainable_params"), "total": run["summary"].get("total_params"),
            "final_loss": run["summary"]["final_loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=1, help="pairs of runs (full, LoRA)")
    parser.add_argument("--model", choices=("demo", "wide"), default="wide")
    bl.add_common_args(parser)
    args = parser.parse_args()
    bl.configure(args)

    work = bl.workdir("trainlift-bench-lora-")
    base = work / "tiny-base"
    common = ["--steps", str(args.steps), "--set", f"model.path={base}", "--set", "train.eval_every=0",
              "--set", "data.eval=null", "--set", f"checkpoint.every_steps={args.steps}", "--set", "train.warmup_steps=2",
              *(WIDE if args.model == "wide" else [])]
    env = bl.clean_env()
    results: dict[str, list[dict]] = {"full": [], "lora": []}
    loads = []
    for i in range(args.repeats):
        for kind in ("full", "lora"):
            loads.append(bl.wait_for_quiet())
            results[kind].append(one_run(kind, common, work, i, env))

    def med(kind: str, key: str) -> float:
        return bl.median([r[key] for r in results[kind]])

    def rss(kind: str) -> float:
        return bl.median([m for r in results[kind] for m in r["peak_rss_mib"]])

    full, lora = results["full"][0], results["lora"][0]
    rows = [
        ["trainable / total parameters", f"{full['trainable']:,} / {full['total']:,}",
         f"{lora['trainable']:,} / {lora['total']:,}", f"{lora['trainable'] / lora['total']:.4f}"],
        ["peak RSS per worker (MiB, median)", f"{rss('full'):.0f}", f"{rss('lora'):.0f}", f"{rss('lora') / rss('full'):.2f}"],
        ["step time (s, median of steps 3..)", f"{med('full', 'step_time_s'):.3f}", f"{med('lora', 'step_time_s'):.3f}",
         f"{med('lora', 'step_time_s') / med('full', 'step_time_s'):.2f}"],
        ["checkpoint bytes (all ranks)", f"{med('full', 'checkpoint_bytes'):,.0f}", f"{med('lora', 'checkpoint_bytes'):,.0f}",
         f"{med('lora', 'checkpoint_bytes') / med('full', 'checkpoint_bytes'):.4f}"],
    ]
    per_run = [[kind, i, ", ".join(f"{m:.0f}" for m in r["peak_rss_mib"]), f"{r['step_time_s']:.3f}",
                f"{r['checkpoint_bytes']:,}", f"{r['final_loss']:.4f}"]
               for kind in ("full", "lora") for i, r in enumerate(results[kind])]
    body = [
        f"Model: the demo spec{' widened to hidden 512, 8 layers' if args.model == 'wide' else ''}, "
        f"{args.steps} steps, 2 workers, micro-batch 8 x seq 128 per worker, fp32 on CPU; LoRA r 16, alpha 32, all "
        "linear layers of the decoder blocks. Ratio = LoRA / full fine-tuning; runs alternate.",
        "", bl.table(["", "full fine-tuning", "LoRA", "ratio"], rows), "",
        bl.table(["run", "#", "peak RSS per worker (MiB)", "step time (s)", "checkpoint bytes", "final loss"], per_run),
    ]
    bl.record("12. LoRA against full fine-tuning", loads, "\n".join(body), key="lora_cost")


if __name__ == "__main__":
    main()
