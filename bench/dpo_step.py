"""Benchmark 21: a DPO step against an SFT step on the same model and rows, and DPO's one-off reference pass.

    python bench/dpo_step.py [--steps 30] [--repeats 2] [--no-record]

Both contenders are `trainlift train` runs of the demo spec (2 CPU workers, gloo, micro-batch 8 x seq 128 per
worker, the model built once beforehand) that differ only in their data and `train.objective`: DPO on
examples/data/prefs-train.jsonl, SFT on the same file's chosen replies as `messages` rows (prompt, then the
chosen reply), so both pack short examples into the same 128-token rows and a step carries about as many tokens;
the table states how many. They alternate (SFT, DPO, SFT, ...) so that a change in the machine's load hits both.
Step time: the median `step_time_s` of steps 3.. of each run. The reference pass (every train example scored once
by the model as it starts, before step 1) is the `"event": "reference"` row's `seconds`, counted once per run and
left out of the step time. No eval split and one checkpoint, at the end, in both.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import benchlib as bl

PREFERENCES = bl.REPO / "examples" / "data" / "prefs-train.jsonl"


def write_chosen_rows(path: Path) -> int:
    """The preference set's prompts with their chosen replies, as SFT `messages` rows; returns the row count."""
    rows = []
    for line in PREFERENCES.read_text(encoding="utf-8").splitlines():
        pair = json.loads(line)
        prompt = pair["prompt"] if isinstance(pair["prompt"], list) else [{"role": "user", "content": pair["prompt"]}]
        rows.append({"messages": [*prompt, {"role": "assistant", "content": pair["chosen"]}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return len(rows)


def one_run(kind: str, common: list[str], data: dict[str, list[str]], work: Path, index: int, env: dict) -> dict:
    name = f"{kind}-{index}"
    run = bl.trainlift_train(common + data[kind], work / "runs", name, env)
    timed = [r for r in run["steps"] if r["step"] >= 3]
    rows = [json.loads(line) for line in (work / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    reference = [r for r in rows if r.get("event") == "reference" and r.get("split") == "train"]
    return {"step_time_s": bl.median([r["step_time_s"] for r in timed]),
            "tokens": bl.median([r["tokens"] for r in timed]),
            "tokens_per_s": bl.median([r["tokens"] / r["step_time_s"] for r in timed]),
            "reference_s": reference[0]["seconds"] if reference else None,
            "reference_examples": reference[0]["examples"] if reference else None,
            "final_loss": run["summary"]["final_loss"], "accuracy": timed[-1].get("rewards/accuracy"),
            "wall_time_s": run["summary"].get("wall_time_s")}


def ratio_rows(results: dict[str, list[dict]]) -> list[list[str]]:
    def med(kind: str, key: str) -> float:
        return bl.median([r[key] for r in results[kind]])

    sft_step, dpo_step = med("sft", "step_time_s"), med("dpo", "step_time_s")
    sft_per_token = bl.median([r["step_time_s"] / r["tokens"] for r in results["sft"]])
    dpo_per_token = bl.median([r["step_time_s"] / r["tokens"] for r in results["dpo"]])
    reference = med("dpo", "reference_s")
    return [
        ["step time (s, median of steps 3..)", f"{sft_step:.3f}", f"{dpo_step:.3f}", f"{dpo_step / sft_step:.2f}"],
        ["tokens per step (real tokens of 16 packed rows)", f"{med('sft', 'tokens'):.0f}",
         f"{med('dpo', 'tokens'):.0f}",
         f"{med('dpo', 'tokens') / med('sft', 'tokens'):.2f}"],
        ["step time per 1k tokens (ms)", f"{sft_per_token * 1e6:.1f}", f"{dpo_per_token * 1e6:.1f}",
         f"{dpo_per_token / sft_per_token:.2f}"],
        ["tokens/s (median over steps 3..)", f"{med('sft', 'tokens_per_s'):.0f}", f"{med('dpo', 'tokens_per_s'):.0f}",
         f"{med('dpo', 'tokens_per_s') / med('sft', 'tokens_per_s'):.2f}"],
        [f"reference pass, once per run (s; {results['dpo'][0]['reference_examples']} examples)", "—",
         f"{reference:.2f}", f"= {reference / dpo_step:.1f} DPO steps"],
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2, help="pairs of runs (SFT, DPO)")
    bl.add_common_args(parser)
    args = parser.parse_args()
    bl.configure(args)

    work = bl.workdir("trainlift-bench-dpo-")
    chosen_rows = write_chosen_rows(work / "chosen.jsonl")
    common = ["--steps", str(args.steps), "--set", f"model.path={bl.prebuilt_model(work)}",
              "--set", "train.eval_every=0", "--set", "data.eval=null", "--set", f"checkpoint.every_steps={args.steps}",
              "--set", "train.warmup_steps=2", "--set", "train.lr=1e-3"]
    data = {"sft": ["--set", f"data.train={work / 'chosen.jsonl'}", "--set", "data.format=messages"],
            "dpo": ["--set", f"data.train={PREFERENCES}", "--set", "data.format=preference",
                    "--set", "train.objective=dpo"]}
    env = bl.clean_env()
    results: dict[str, list[dict]] = {"sft": [], "dpo": []}
    loads = []
    for i in range(args.repeats):
        for kind in ("sft", "dpo"):
            loads.append(bl.wait_for_quiet())
            results[kind].append(one_run(kind, common, data, work, i, env))

    per_run = [[kind, i, f"{r['step_time_s']:.3f}", f"{r['tokens']:.0f}", f"{r['tokens_per_s']:.0f}",
                "—" if r["reference_s"] is None else f"{r['reference_s']:.2f}", f"{r['final_loss']:.4f}",
                "—" if r["accuracy"] is None else f"{r['accuracy']:.0%}", f"{r['wall_time_s']:.1f}"]
               for kind in ("sft", "dpo") for i, r in enumerate(results[kind])]
    body = [
        f"Model: the demo spec, {args.steps} steps, 2 workers, micro-batch 8 x seq 128 per worker (16 packed rows a "
        f"step), fp32 on CPU, lr 1e-3. DPO: {chosen_rows} pairs of examples/data/prefs-train.jsonl (beta 0.1); SFT: "
        "the same prompts with their chosen replies. Ratio = DPO / SFT; runs alternate. Step time leaves out the "
        "reference pass, which DPO pays once per run before its first step (read back, not rescored, on a resume).",
        "", bl.table(["", "SFT (chosen replies)", "DPO (pairs)", "ratio"], ratio_rows(results)), "",
        bl.table(["run", "#", "step time (s)", "tokens/step", "tokens/s", "reference pass (s)", "final loss",
                  "last step's reward accuracy", "wall time (s)"], per_run),
    ]
    bl.record("21. DPO step against SFT step", loads, "\n".join(body), key="dpo_step")


if __name__ == "__main__":
    main()
