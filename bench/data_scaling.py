"""Benchmark 8: data scaling. Time to first step and per-worker memory with the demo data ×1 and ×25.

    python bench/data_scaling.py [--rounds 2] [--steps 3] [--baseline-src DIR] [--no-record]

`trainlift train examples/tiny-local.yaml` (2 workers) on the demo training split as it is (4,000 rows) and
repeated 25 times (100,000 rows), each as a first run (fresh storage: the driver tokenizes and packs the data
into the cache) and a second run (same storage, new run name: the cache is found and mapped). The cases
alternate within each round, so load from other work falls on all of them alike. Time to first step runs from
launching the command to the end of step 1 (its `time` in metrics.jsonl); memory is each Ray Train worker's
peak resident set (VmHWM), sampled from outside. With `--baseline-src` (the `src/` folder of a checkout of
the code before the cache), the same two sizes also run on that code, where every worker reads and packs the
whole file itself at every start.
"""

from __future__ import annotations

import argparse
import os
import shutil

import benchlib as bl

SCALES = (1, 25)
TARGET_TIME_RATIO = 1.3
TARGET_RSS_GROWTH_MIB = 100


def scaled_data(work, scale: int) -> str:
    source = bl.REPO / "examples" / "data" / "tasks-train.jsonl"
    path = work / f"train-x{scale}.jsonl"
    text = source.read_text()
    path.write_text(text * scale)
    return str(path)


def first_step_s(run: dict) -> float:
    return run["steps"][0]["time"] - run["t0"]


def one_run(work, model: str, train: str, storage, name: str, steps: int, src: str | None = None) -> dict:
    env = bl.clean_env(TRAINLIFT_HOME=str(work / "home"))
    if src:
        env["PYTHONPATH"] = src
    args = ["--steps", str(steps), "--set", f"model.path={model}", "--set", f"data.train={train}",
            "--set", "checkpoint.every_steps=0", "--set", "train.eval_every=0"]
    try:
        run = bl.trainlift_train(args, storage, name, env, sample_memory=True)
    except RuntimeError as exc:  # on a loaded machine Ray itself can time out starting; that run is retried once
        if "timed out during startup" not in str(exc):
            raise
        run = bl.trainlift_train(args, storage, name, env, sample_memory=True)
    return {"first_step_s": first_step_s(run), "rss_mib": run["peak_rss_mib"],
            "built": {k: v["built"] for k, v in run["summary"].get("data_cache", {}).items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--baseline-src", help="src/ of a checkout of the code before the data cache")
    bl.add_common_args(parser)
    args = parser.parse_args()
    bl.configure(args)

    work = bl.workdir("trainlift-bench-scaling-")
    model = bl.prebuilt_model(work)
    data = {scale: scaled_data(work, scale) for scale in SCALES}
    kinds = ("first", "second", "baseline") if args.baseline_src else ("first", "second")

    def cases_in(scales):
        return [(f"x{s} before the cache" if kind == "baseline" else f"x{s} {kind}", s, kind)
                for kind in kinds for s in scales]

    cases = cases_in(SCALES)
    results: dict[str, list[dict]] = {label: [] for label, _, _ in cases}
    loads = []
    for r in range(args.rounds):
        storages = {s: work / f"runs-r{r}-x{s}" for s in SCALES}
        # A first run must come before its second run; the sizes swap order every round.
        for label, scale, kind in cases_in(SCALES if r % 2 == 0 else SCALES[::-1]):
            loads.append(bl.wait_for_quiet())
            storage = work / f"baseline-r{r}-x{scale}" if kind == "baseline" else storages[scale]
            result = one_run(work, model, data[scale], storage, f"{kind}-{r}", args.steps,
                             args.baseline_src if kind == "baseline" else None)
            print(f"round {r} {label}: {result}", flush=True)
            results[label].append(result)
            if kind == "baseline":
                shutil.rmtree(storage, ignore_errors=True)

    def med(label, key):
        return bl.median([x[key] for x in results[label]])

    def rss(label):
        return bl.median([max(x["rss_mib"]) for x in results[label] if x["rss_mib"]])

    rows = []
    for label, scale, kind in cases:
        built = sorted({str(x["built"].get("train")) for x in results[label]}) if kind != "baseline" else ["—"]
        rows.append([label, f"{med(label, 'first_step_s'):.2f}",
                     " ".join(f"{x['first_step_s']:.1f}" for x in results[label]),
                     f"{rss(label):.0f}", "/".join(built)])
    time_ratio = med("x25 second", "first_step_s") / med("x1 second", "first_step_s")
    growth = rss("x25 second") - rss("x1 second")
    body = [
        f"Demo config with the training split ×1 (4,000 rows, {os.path.getsize(data[1]) / 2**20:.1f} MiB) and ×25 "
        f"(100,000 rows, {os.path.getsize(data[25]) / 2**20:.1f} MiB), 2 workers, {args.steps} steps, "
        f"{args.rounds} rounds with the cases alternated. Time from launching `trainlift train` to the end of step 1; "
        "peak RSS is the larger of the two workers' VmHWM; `cache built` is what the driver reported.\n",
        bl.table(["case", "median s to first step", "runs s", "worker peak RSS MiB (median)", "cache built"], rows),
        f"\n**Second run, ×25 / ×1 time to first step = {time_ratio:.2f}** (target ≤ {TARGET_TIME_RATIO}): "
        f"**{'met' if time_ratio <= TARGET_TIME_RATIO else 'missed'}**. "
        f"**Worker RSS growth ×1 → ×25 = {growth:+.0f} MiB** (target < {TARGET_RSS_GROWTH_MIB}): "
        f"**{'met' if growth < TARGET_RSS_GROWTH_MIB else 'missed'}**. "
        f"First run ×25 / ×1 = {med('x25 first', 'first_step_s') / med('x1 first', 'first_step_s'):.2f} "
        "(the driver tokenizes and packs the whole set once, before Ray starts).",
    ]
    if args.baseline_src:
        body.append(
            f"Before the cache: ×25 / ×1 time to first step = "
            f"{med('x25 before the cache', 'first_step_s') / med('x1 before the cache', 'first_step_s'):.2f}, "
            f"worker RSS growth {rss('x25 before the cache') - rss('x1 before the cache'):+.0f} MiB.")
    bl.record("11. Data scaling", loads, "\n".join(body), key="data_scaling")


if __name__ == "__main__":
    main()
