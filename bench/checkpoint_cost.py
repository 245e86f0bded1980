"""Benchmark 4: what a checkpoint costs, synchronous and with `dcp.async_save`, and which interval keeps it
under 5% of training time.

    python bench/checkpoint_cost.py [--interval 20] [--saves 8] [--no-record]

Part A (standalone, torch.distributed.checkpoint only): 2 gloo processes train the demo model with
trainlift's own step (`recipe.train_step`). Three blocks of `--saves` stretches of `--interval` steps:
no save, trainlift's synchronous shard writer (`checkpoint.write_shard`), and `dcp.async_save` on its
own gloo group with at most one save in flight (each save first waits for the previous one). After each
save point the next `PROBE` steps are timed one by one. One save costs the time the loop is blocked plus
what those steps take beyond the block's normal step (an async write competes with them for the CPU);
the no-save block measures the same quantity with nothing saved, i.e. the noise floor.
Part B (in a real run): `trainlift train` with a checkpoint every 10 steps; the gap a checkpoint step
leaves between two step ends, minus a normal step, is what one checkpoint boundary costs trainlift
(shard write, Ray Train's upload and `report()`, barrier, COMPLETE marker, pruning).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import time
from pathlib import Path

import benchlib as bl

TARGET = 0.05
VARIANTS = ("none", "sync", "async")
PROBE = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world: int, port: int, model_path: str, interval: int, saves: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from trainlift.config.job import load_job_spec
    from trainlift.train import recipe
    from trainlift.train.data import examples as data
    from trainlift.train.run import checkpoint
    from trainlift.train.model.build import apply_fsdp, load_model, load_tokenizer

    dist.init_process_group("gloo", rank=rank, world_size=world)
    ckpt_group = dist.new_group(backend="gloo")
    device = torch.device("cpu")
    spec = load_job_spec(bl.REPO / bl.DEMO_SPEC, [f"model.path={model_path}"])
    packed = data.prepare(str(bl.REPO / spec.data.train), spec.data.format, load_tokenizer(spec.model), spec.data.seq_len)
    model = apply_fsdp(load_model(spec.model, spec.train.seed), device, False, False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.train.lr, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, recipe.lr_lambda(spec.train.warmup_steps, 10**6, 0.1))
    per_step = world * spec.train.micro_batch_size
    state = {"step": 0}

    def train(n: int) -> list[float]:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            batches = recipe.step_batches(packed, spec, state["step"] * per_step, rank, world, device)
            recipe.train_step(model, optimizer, scheduler, batches, spec.train.max_grad_norm, world, device)
            state["step"] += 1
            times.append(time.perf_counter() - t0)
        return times

    train(10)
    out = {v: {"normal": [], "probe": [], "blocking": [], "flight": []} for v in VARIANTS}
    pending = None
    for variant in VARIANTS:
        rec = out[variant]
        for n in range(saves):
            rec["normal"] += train(interval)
            t0 = time.perf_counter()
            if variant == "sync":
                checkpoint.write_shard(f"{out_dir}/sync-{n}", model, optimizer, scheduler, state["step"], 0, rank, world)
            elif variant == "async":
                if pending is not None:
                    pending.result()
                model_sd, optim_sd = get_state_dict(model, optimizer)
                pending = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{out_dir}/async-{n}",
                                         process_group=ckpt_group)
                pending.add_done_callback(lambda _f, t0=t0, rec=rec: rec["flight"].append(time.perf_counter() - t0))
            rec["blocking"].append(time.perf_counter() - t0)
            rec["probe"].append(train(PROBE))
        if pending is not None:
            pending.result()
            pending = None
    size = sum(f.stat().st_size for f in Path(f"{out_dir}/sync-0").rglob("*") if f.is_file())
    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    if rank == 0:
        (Path(out_dir) / "result.json").write_text(json.dumps({"ranks": gathered, "bytes": size}))
    dist.destroy_process_group()


def standalone(model: str, interval: int, saves: int, work: Path) -> dict:
    import torch.multiprocessing as mp

    out_dir = work / "dcp"
    out_dir.mkdir()
    mp.spawn(worker, args=(2, free_port(), model, interval, saves, str(out_dir)), nprocs=2, join=True)
    return json.loads((out_dir / "result.json").read_text())


def per_save_cost(rec: dict) -> dict:
    """Blocked time plus the probe steps' excess over the block's normal step, per save (median over saves)."""
    normal = statistics.median(rec["normal"])
    excess = [sum(t - normal for t in probe) for probe in rec["probe"]]
    return {"normal": normal, "blocking": statistics.median(rec["blocking"]), "excess": statistics.median(excess),
            "cost": statistics.median(b + e for b, e in zip(rec["blocking"], excess)),
            "flight": statistics.median(rec["flight"]) if rec["flight"] else None}


def in_run(model: str, work: Path, env: dict, steps: int, every: int) -> dict:
    run = bl.trainlift_train(["--steps", str(steps), "--set", f"model.path={model}", "--set", "train.eval_every=0",
                              "--set", f"checkpoint.every_steps={every}"], work / "runs", "ckpt", env)
    rows = run["steps"]
    gaps = {r["step"]: b["time"] - r["time"] for r, b in zip(rows, rows[1:])}
    boundary = [g for s, g in gaps.items() if s % every == 0]
    normal = [g for s, g in gaps.items() if s % every != 0 and s > 2]
    return {"boundary": boundary, "normal": bl.median(normal)}


def share(cost: float, step_s: float, interval: int) -> float:
    return cost / (interval * step_s + cost)


def needed_interval(cost: float, step_s: float) -> int:
    return max(1, int(-(-cost * (1 - TARGET) / (TARGET * step_s))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=int, default=20, help="training steps between save points in part A")
    parser.add_argument("--saves", type=int, default=8, help="save points per variant in part A")
    parser.add_argument("--run-steps", type=int, default=42, help="steps of the in-run measurement (part B)")
    bl.add_common_args(parser)
    args = parser.parse_args()
    bl.configure(args)

    work = bl.workdir("trainlift-bench-ckpt-")
    model = bl.prebuilt_model(work)
    loads = [bl.wait_for_quiet()]
    a = standalone(model, args.interval, args.saves, work)
    loads.append(bl.wait_for_quiet())
    b = in_run(model, work, bl.clean_env(TRAINLIFT_HOME=str(work / "home")), args.run_steps, 10)
    shutil.rmtree(work, ignore_errors=True)

    # Rank 0's view; collectives keep the two ranks in step.
    costs = {v: per_save_cost(a["ranks"][0][v]) for v in VARIANTS}
    step_s = costs["none"]["normal"]
    rows = []
    for variant, label in (("none", "no save (noise floor)"), ("sync", "synchronous (`checkpoint.write_shard`)"),
                           ("async", "`dcp.async_save`, ≤ 1 in flight")):
        c = costs[variant]
        rows.append([label, f"{c['blocking']:.3f}", f"{c['excess']:+.3f}", f"{c['cost']:.3f}",
                     f"{share(c['cost'], step_s, 50):.1%}", f"{share(c['cost'], step_s, 100):.1%}",
                     needed_interval(c["cost"], step_s) if variant != "none" else "—"])
    boundary = bl.median(b["boundary"]) - b["normal"]
    body = [
        f"Demo model ({a['bytes'] / 2**20:.1f} MiB per checkpoint: fp32 weights + AdamW state, 2 shards), 2 gloo "
        f"workers, 1 thread each, local disk. Part A: {args.saves} save points per variant, {args.interval} steps "
        f"apart, {PROBE} timed steps after each; normal step {step_s * 1000:.0f} ms. An async save is written "
        f"{costs['async']['flight']:.3f} s (median) after it starts. Shares are of wall time at a save every 50 "
        "steps (the JobSpec default) and every 100 (the demo); every column is a median over the saves.\n",
        bl.table(["part A: variant", "blocked s", f"next {PROBE} steps' excess s",
                  "cost per save s (blocked + excess)", "share @ 50",
                  "share @ 100", "steps between saves for ≤ 5%"], rows),
        f"\nPart B, inside `trainlift train` (checkpoint every 10 steps, {args.run_steps} steps, no eval): a normal "
        f"step takes {b['normal'] * 1000:.0f} ms; a checkpoint step's gap is {bl.median(b['boundary']):.3f} s "
        f"(each: {', '.join(f'{g:.2f}' for g in b['boundary'])}), so **one checkpoint boundary costs "
        f"{boundary:.2f} s**: **{share(boundary, b['normal'], 50):.1%}** of wall time at the default 50 steps, "
        f"**{share(boundary, b['normal'], 100):.1%}** at the demo's 100; ≤ 5% needs ≥ "
        f"{needed_interval(boundary, b['normal'])} steps between checkpoints at this step time.",
    ]
    bl.record("4. Checkpoint cost", loads, "\n".join(body), key="checkpoint_cost")


if __name__ == "__main__":
    main()
