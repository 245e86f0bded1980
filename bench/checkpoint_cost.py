"""Benchmark 4: what checkpointing costs, synchronous and with `dcp.async_save`, and which interval keeps
it under 5% of training time.

    python bench/checkpoint_cost.py [--interval 50] [--rounds 3] [--no-record]

Part A (standalone, torch.distributed.checkpoint only): 2 gloo processes train the demo model with
trainlift's own step (`recipe.train_step`) and save with trainlift's shard writer. Blocks of
`--rounds` stretches of `--interval` steps run with no save, a synchronous save at each stretch's end, an
async save started at each stretch's end (at most one in flight: a save first waits for the previous
one; the block ends when the last is written), and no save again; the overhead is the extra wall time
against the no-save stretches.
Part B (in a real run): `trainlift train` with a checkpoint every 10 steps; the gap a checkpoint step
leaves between two step ends, minus a normal step, is what one checkpoint boundary costs trainlift.
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world: int, port: int, model_path: str, interval: int, rounds: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from trainlift.config.job import load_job_spec
    from trainlift.train import checkpoint, data, recipe
    from trainlift.train.model import apply_fsdp, load_model, load_tokenizer

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

    def train(n: int) -> None:
        for _ in range(n):
            batches = recipe.step_batches(packed, spec, state["step"] * per_step, rank, world, device)
            recipe.train_step(model, optimizer, scheduler, batches, spec.train.max_grad_norm, world, device)
            state["step"] += 1

    train(10)
    results = {v: [] for v in VARIANTS}
    saves = {"sync": [], "async_blocking": [], "async_flight": []}
    pending = None
    for variant in ("none", "sync", "async", "none"):
        for r in range(rounds):
            dist.barrier()
            t0 = time.perf_counter()
            train(interval)
            if variant == "sync":
                s0 = time.perf_counter()
                checkpoint.write_shard(f"{out_dir}/sync-{r}", model, optimizer, scheduler, state["step"], 0, rank, world)
                saves["sync"].append(time.perf_counter() - s0)
            elif variant == "async":
                if pending is not None:
                    pending.result()
                s0 = time.perf_counter()
                model_sd, optim_sd = get_state_dict(model, optimizer)
                pending = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{out_dir}/async-{r}",
                                         process_group=ckpt_group)
                saves["async_blocking"].append(time.perf_counter() - s0)
                pending.add_done_callback(lambda _f, s0=s0: saves["async_flight"].append(time.perf_counter() - s0))
                if r == rounds - 1:  # the last save's remaining write belongs to this block
                    pending.result()
            dist.barrier()
            results[variant].append(time.perf_counter() - t0)
    size = sum(f.stat().st_size for f in Path(f"{out_dir}/sync-0").rglob("*") if f.is_file())
    gathered = [None] * world
    dist.all_gather_object(gathered, {"results": results, "saves": saves})
    if rank == 0:
        (Path(out_dir) / "result.json").write_text(json.dumps({"ranks": gathered, "bytes": size}))
    dist.destroy_process_group()


def standalone(model: str, interval: int, rounds: int, work: Path) -> dict:
    import torch.multiprocessing as mp

    out_dir = work / "dcp"
    out_dir.mkdir()
    mp.spawn(worker, args=(2, free_port(), model, interval, rounds, str(out_dir)), nprocs=2, join=True)
    return json.loads((out_dir / "result.json").read_text())


def in_run(model: str, work: Path, env: dict, steps: int, every: int) -> dict:
    run = bl.trainlift_train(["--steps", str(steps), "--set", f"model.path={model}", "--set", "train.eval_every=0",
                              "--set", f"checkpoint.every_steps={every}"], work / "runs", "ckpt", env)
    rows = run["steps"]
    gaps = {r["step"]: b["time"] - r["time"] for r, b in zip(rows, rows[1:])}
    boundary = [g for s, g in gaps.items() if s % every == 0]
    normal = [g for s, g in gaps.items() if s % every != 0 and s > 2]
    return {"boundary": boundary, "normal": bl.median(normal)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=int, default=50, help="steps between saves (the JobSpec default is 50)")
    parser.add_argument("--rounds", type=int, default=3, help="stretches per variant")
    parser.add_argument("--run-steps", type=int, default=42, help="steps of the in-run measurement (part B)")
    bl.add_common_args(parser)
    args = parser.parse_args()
    bl.configure(args)

    work = bl.workdir("trainlift-bench-ckpt-")
    model = bl.prebuilt_model(work)
    loads = [bl.wait_for_quiet()]
    a = standalone(model, args.interval, args.rounds, work)
    loads.append(bl.wait_for_quiet())
    b = in_run(model, work, bl.clean_env(TRAINLIFT_HOME=str(work / "home")), args.run_steps, 10)
    shutil.rmtree(work, ignore_errors=True)

    stretch = {v: statistics.mean(max(r["results"][v][i] for r in a["ranks"]) for i in range(len(a["ranks"][0]["results"][v])))
               for v in VARIANTS}
    saves = {k: bl.median([x for r in a["ranks"] for x in r["saves"][k]]) for k in a["ranks"][0]["saves"]}
    step_s = stretch["none"] / args.interval
    rows = []
    for variant, per_save in (("sync", saves["sync"]), ("async", saves["async_blocking"])):
        extra = stretch[variant] - stretch["none"]
        share = extra / stretch[variant]
        rows.append([variant, f"{per_save:.3f}", f"{stretch[variant]:.2f}", f"{extra:+.3f}", f"{share:.1%}",
                     int(-(-extra / (TARGET / (1 - TARGET) * step_s))) if extra > 0 else 1])
    boundary = bl.median(b["boundary"]) - b["normal"]
    b_steps = int(-(-boundary / (TARGET / (1 - TARGET) * b["normal"])))
    body = [
        f"Demo model ({a['bytes'] / 2**20:.1f} MiB per checkpoint: fp32 weights + AdamW state, 2 shards), 2 gloo "
        f"workers, 1 thread each, local disk. Part A: {args.rounds} stretches of {args.interval} steps per variant, "
        f"no-save stretches before and after the others (mean training step {step_s * 1000:.0f} ms; no-save stretch {stretch['none']:.2f} s); async saves use "
        f"their own gloo group and at most one is in flight (median {saves['async_flight']:.3f} s from start to "
        "written).\n",
        bl.table(["variant", "blocking s per save", f"stretch of {args.interval} steps + save, s",
                  "extra wall time s", "share of wall time", "interval for ≤ 5%"], rows),
        f"\nPart B, inside `trainlift train` (checkpoint every 10 steps, {args.run_steps} steps, no eval): a normal "
        f"step takes {b['normal'] * 1000:.0f} ms; a checkpoint step's gap is {bl.median(b['boundary']):.3f} s "
        f"(runs: {', '.join(f'{g:.2f}' for g in b['boundary'])}), so **one checkpoint boundary costs "
        f"{boundary:.2f} s** (DCP save + Ray Train's upload of the shards and `report()` + barrier + COMPLETE). "
        f"At the default interval of 50 steps that is "
        f"**{boundary / (50 * b['normal'] + boundary):.1%}** of wall time; at the demo's 100, "
        f"**{boundary / (100 * b['normal'] + boundary):.1%}**. Staying ≤ 5% needs ≥ {b_steps} steps between "
        "checkpoints at this step time.",
    ]
    bl.record("4. Checkpoint cost", loads, "\n".join(body))


if __name__ == "__main__":
    main()
