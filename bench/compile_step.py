"""Benchmark 21: compiled decoder blocks (train.compile) against eager, and activation checkpointing none,
selective and full: step time and peak memory of a small Llama on the CPU.

    python bench/compile_step.py [--steps 14] [--warmup 3] [--repeats 2] [--no-record]

Each configuration runs in a process of its own, on a world of one (gloo, one thread), built and sharded by
trainlift's `apply_fsdp` (`compile_blocks`, `BlockCheckpointing`) and stepped with the recipe's loss
(`loss.token_loss_sum`), gradient clipping and AdamW on the same packed rows (several examples per row) every step.
Its Inductor cache is a fresh directory, so the first step compiles from nothing: compile time is the first step's
time less the median step. Step time: the median of the steps after `--warmup`. Peak memory: the process's peak
resident set (VmHWM, reset just before the timed steps) above its resident set then, with
MALLOC_MMAP_THRESHOLD_=131072 so that freed tensors leave the heap (benchmark 15); next to it, what
`trainlift estimate` counts for the activations of the same model and batch. Ratios are against eager without
checkpointing, measured in the same run; the configurations alternate when `--repeats` is above 1.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchlib as bl

MODEL = {"model_type": "llama", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 704,
         "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
         "tie_word_embeddings": False}
SEQ, ROWS = 256, 4
CONFIGS = [  # (name, train.compile, model.activation_checkpointing, _keeps)
    ("eager, none", False, "none", "inputs"), ("compiled, none", True, "none", "inputs"),
    ("eager, selective", False, "selective", "inputs"), ("compiled, selective", True, "selective", "inputs"),
    ("eager, full", False, "full", "inputs"), ("compiled, full", True, "full", "inputs"),
    ("eager, full keeping matmuls", False, "full", "matmuls"),
]


def packed_batch():
    """ROWS rows of SEQ tokens, each packed with examples of 16 to 200 tokens (position ids restart at each)."""
    import random

    from trainlift.train.data import examples as data

    rng = random.Random(0)
    examples = []
    while len(examples) < 4 * ROWS * SEQ // 100:
        ids = [rng.randrange(MODEL["vocab_size"]) for _ in range(rng.randrange(16, 200))]
        examples.append(data.Example(ids, ids))
    return data.collate(data.pack(examples, SEQ, pad_id=0).rows[:ROWS])


def rss_kib(field: str) -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))


def one(config: dict, steps: int, warmup: int) -> dict:
    """One configuration, in this process: its step times, compile time, peak memory and losses."""
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainlift.train.model.build import BlockCheckpointing, apply_fsdp
    from trainlift.train.model.loss import token_loss_sum

    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.manual_seed(0)
    hf_config = AutoConfig.for_model(**MODEL)
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
    model = apply_fsdp(model, torch.device("cpu"), bf16=False, compile_blocks=config["compile"],
                       activation_checkpointing=BlockCheckpointing(config["ac"], 2, config["keeps"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95))
    batch = packed_batch()
    times, losses = [], []
    for step in range(steps):
        if step == warmup:
            Path("/proc/self/clear_refs").write_text("5")
            base_kib = rss_kib("VmRSS")
        t0 = time.perf_counter()
        loss = token_loss_sum(model, batch) / int(batch["trainable_tokens"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    peak_kib = rss_kib("VmHWM") - base_kib
    step_s = statistics.median(times[warmup:])
    dist.destroy_process_group()
    return {"step_s": step_s, "first_step_s": times[0], "compile_s": times[0] - step_s if config["compile"] else 0.0,
            "peak_mib": peak_kib / 1024, "losses": losses, "graphs": counters["stats"].get("unique_graphs", 0),
            "graph_breaks": sum(counters["graph_break"].values())}


def run_config(config: dict, steps: int, warmup: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="trainlift-bench-inductor-") as cache:
        env = bl.clean_env(MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1", TORCHINDUCTOR_CACHE_DIR=cache,
                           TORCHINDUCTOR_COMPILE_THREADS="1")
        proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(config), "--steps", str(steps),
                               "--warmup", str(warmup)], cwd=bl.REPO, env=env, capture_output=True, text=True,
                              timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{config} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def estimated_activations_mib(ac: str, keeps: str) -> float:
    """What `trainlift estimate` counts for the activations of this model and batch on a CPU worker."""
    from transformers import AutoConfig

    from trainlift.estimate.memory import Workload, memory_items
    from trainlift.estimate.shape import shape_of

    w = Workload(ROWS, SEQ, 1, ac, gpu=False, bf16=False, workers=1, checkpoint_keeps=keeps)
    return memory_items(shape_of(AutoConfig.for_model(**MODEL)), w, runtime_bytes=0)["activations"] / 2**20


def rows_of(results: dict[str, list[dict]]) -> list[list]:
    def med(name: str, key: str) -> float:
        return bl.median([r[key] for r in results[name]])

    base_step, base_peak = med("eager, none", "step_s"), med("eager, none", "peak_mib")
    rows = []
    for name, compiled, ac, keeps in CONFIGS:
        first = results[name][0]
        rows.append([name, f"{med(name, 'step_s'):.3f}", f"{med(name, 'step_s') / base_step:.2f}",
                     f"{med(name, 'compile_s'):.1f}" if compiled else "-", f"{med(name, 'peak_mib'):.0f}",
                     f"{med(name, 'peak_mib') / base_peak:.2f}", f"{estimated_activations_mib(ac, keeps):.0f}",
                     f"{first['graphs']} / {first['graph_breaks']}" if compiled else "-",
                     f"{first['losses'][0]:.6f}", f"{first['losses'][-1]:.6f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the median (the first compiles)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds over every configuration")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    bl.add_common_args(parser)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(json.loads(args.one), args.steps, args.warmup)))
        return
    bl.configure(args)
    results: dict[str, list[dict]] = {name: [] for name, *_ in CONFIGS}
    loads = []
    for _ in range(args.repeats):
        for name, compiled, ac, keeps in CONFIGS:
            loads.append(bl.wait_for_quiet())
            results[name].append(run_config({"compile": compiled, "ac": ac, "keeps": keeps}, args.steps,
                                            args.warmup))
            print(f"{name}: {results[name][-1]['step_s']:.3f} s/step", file=sys.stderr, flush=True)
    body = describe(results, args)
    bl.record("22. Compiled blocks and selective activation checkpointing", loads, body, key="compile_step")


def describe(results: dict[str, list[dict]], args) -> str:
    rows = rows_of(results)
    layers, width = MODEL["num_hidden_layers"], MODEL["hidden_size"]
    table = bl.table(["configuration", "s/step (median)", "step vs eager, none", "compile s", "peak MiB above start",
                      "peak vs eager, none", "estimate's activations MiB", "graphs / breaks", "loss step 1",
                      f"loss step {args.steps}"], rows)
    return (f"Llama, {layers} layers, hidden {width}, vocabulary {MODEL['vocab_size']}, fp32 on one CPU thread; "
            f"{ROWS} packed rows of {SEQ} tokens per step; {args.steps} steps of which {args.warmup} warm-up; "
            f"{args.repeats} round(s); selective checkpoints every 2nd block, `keeps` inputs unless named.\n\n"
            f"{table}\n\n{summary(results)}\n")


def summary(results: dict[str, list[dict]]) -> str:
    def med(name: str, key: str) -> float:
        return bl.median([r[key] for r in results[name]])

    def ratio(name: str, key: str, base: str = "eager, none") -> str:
        return f"{med(name, key) / med(base, key):.2f}x"

    reference = results["eager, none"][0]["losses"]
    eager = [name for name, compiled, *_ in CONFIGS if not compiled]
    same = all(r["losses"] == reference for name in eager for r in results[name])
    compiled_gap = max(abs(loss - eager_loss) for name, compiled, *_ in CONFIGS if compiled for r in results[name]
                       for loss, eager_loss in zip(r["losses"], reference))
    drops = "; ".join(
        f"{name.removeprefix('eager, ')} {med('eager, none', 'peak_mib') - med(name, 'peak_mib'):.0f} MiB (estimate "
        f"{estimated_activations_mib('none', 'inputs') - estimated_activations_mib(ac, keeps):.0f})"
        for name, compiled, ac, keeps in CONFIGS if not compiled and ac != "none")
    return (f"Compiled blocks take {ratio('compiled, none', 'step_s')} the eager step time without checkpointing "
            f"and {ratio('compiled, full', 'step_s', 'eager, full')} of it with full checkpointing, after "
            f"{med('compiled, none', 'compile_s'):.0f} s of compiling in the first step. Selective checkpointing "
            f"peaks at {ratio('eager, selective', 'peak_mib')} of no checkpointing's memory for "
            f"{ratio('eager, selective', 'step_s')} its step time; full at {ratio('eager, full', 'peak_mib')} for "
            f"{ratio('eager, full', 'step_s')}; full keeping matmul outputs at "
            f"{ratio('eager, full keeping matmuls', 'peak_mib')} for {ratio('eager, full keeping matmuls', 'step_s')}. "
            f"What checkpointing saves against none, measured and as `trainlift estimate` counts it: {drops}. "
            f"The eager runs' losses are {'identical' if same else 'not identical'} in every step, checkpointed or "
            f"not; the compiled runs' differ from them by at most {compiled_gap:.1e}.")


if __name__ == "__main__":
    main()
