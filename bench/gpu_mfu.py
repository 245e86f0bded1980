"""Benchmark 7: tokens/s, MFU and peak memory of a Qwen2.5-1.5B-architecture model on one GPU.

    python bench/gpu_mfu.py [--steps 20] [--warmup 5] [--batch 4] [--seq 2048] [--ac both] [--compile both]
    python bench/gpu_mfu.py --tiny --steps 2 --no-record       # CPU smoke run, as the test suite does

The model is built from the Qwen2.5-1.5B configuration (random init, nothing downloaded) with SDPA
attention and sharded with trainlift's own FSDP2 wrapping on a world of one: bf16 compute, fp32 master
weights and gradient reduction, AdamW, trainlift's loss (`loss.token_loss_sum`) on random tokens.
Each combination of activation checkpointing and torch.compile (per decoder layer, then FSDP, as
torchtitan does) is timed after warm-up; a combination that fails is reported with its error and the
rest still run. MFU = tokens/s × FLOPs/token ÷ the device's dense bf16 peak from trainlift's catalog
(null on a CPU or an unknown GPU). Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import socket
import statistics
import time
import traceback

import benchlib as bl

QWEN25_15B = {  # Qwen/Qwen2.5-1.5B config.json
    "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
    "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 131072,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_act": "silu",
    "use_sliding_window": False, "attention_dropout": 0.0,
}
TINY = {
    "model_type": "qwen2", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": True,
}


def choices(value: str) -> list[bool]:
    return {"on": [True], "off": [False], "both": [False, True]}[value]


def init_single_process_group(device) -> None:
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)


def build(config, device, bf16: bool, ac: bool, compiled: bool, seq: int):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    from trainlift.train.model.build import apply_fsdp, flops_per_token

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    fpt = flops_per_token(model, seq)
    if not compiled:
        return apply_fsdp(model, device, bf16, ac), fpt
    if ac:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    layers = model.model.layers
    for i in range(len(layers)):
        layers[i] = torch.compile(layers[i])
        fully_shard(layers[i], mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model, fpt


def measure(config, device, args, ac: bool, compiled: bool, peak: float | None) -> dict:
    import torch

    from trainlift.train.model.loss import token_loss_sum

    bf16 = device.type == "cuda"
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model, fpt = build(config, device, bf16, ac, compiled, args.seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), fused=device.type == "cuda")
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=generator).to(device)
    batch = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(args.seq, device=device).expand(args.batch, -1)}
    tokens = args.batch * args.seq
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = token_loss_sum(model, batch) / tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    warmup = min(args.warmup, args.steps - 1)
    step_s = statistics.median(times[warmup:])
    tokens_per_s = tokens / step_s
    if device.type == "cuda":
        peak_mem = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        peak_mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    del model, optimizer, batch, loss
    gc.collect()
    return {"activation_checkpointing": ac, "compile": compiled, "step_s": step_s, "first_step_s": times[0],
            "tokens_per_s": tokens_per_s, "mfu": tokens_per_s * fpt / peak if peak else None,
            "peak_memory_gib": peak_mem, "flops_per_token": fpt, "error": None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny Qwen2 config, seq 64, batch 2: a smoke run for any machine")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the median (at most steps-1)")
    parser.add_argument("--batch", type=int, default=None, help="micro-batch (default 4; 2 with --tiny)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 2048; 64 with --tiny)")
    parser.add_argument("--ac", choices=("on", "off", "both"), default="both", help="activation checkpointing")
    parser.add_argument("--compile", choices=("on", "off", "both"), default=None,
                        help="torch.compile per decoder layer (default both; off with --tiny)")
    parser.add_argument("--no-record", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = parser.parse_args()
    args.batch = args.batch or (2 if args.tiny else 4)
    args.seq = args.seq or (64 if args.tiny else 2048)
    args.compile = args.compile or ("off" if args.tiny else "both")
    bl.QUIET["record"] = not args.no_record
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import torch
    import torch.distributed as dist

    from trainlift.catalog import peak_flops_for_device_name
    from trainlift.train.model.build import build_config

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_flops_for_device_name(name) if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.set_device(device)
    config = build_config(TINY if args.tiny else QWEN25_15B)
    loads = [bl.load()]
    init_single_process_group(device)
    results = []
    try:
        for compiled in choices(args.compile):
            for ac in choices(args.ac):
                try:
                    results.append(measure(config, device, args, ac, compiled, peak))
                except Exception as exc:  # noqa: BLE001 - one failing combination must not hide the others
                    traceback.print_exc()
                    results.append({"activation_checkpointing": ac, "compile": compiled, "tokens_per_s": None,
                                    "mfu": None, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"})
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()

    ok = [r for r in results if r["error"] is None]
    best = max(ok, key=lambda r: r["tokens_per_s"]) if ok else None
    fpt = ok[0]["flops_per_token"] if ok else None
    mem_label = "peak GPU memory GiB" if device.type == "cuda" else "peak process RSS GiB"
    rows = [["on" if r["activation_checkpointing"] else "off", "on" if r["compile"] else "off",
             "—" if r["error"] else f"{r['step_s'] * 1000:.1f}",
             "—" if r["error"] else f"{r['tokens_per_s']:,.0f}",
             "—" if r["mfu"] is None else f"{r['mfu']:.1%}",
             "—" if r["error"] else f"{r['peak_memory_gib']:.2f}", r["error"] or ""] for r in results]
    body = [
        f"{'Tiny Qwen2 smoke configuration' if args.tiny else 'Qwen2.5-1.5B architecture'} on {name}, "
        f"{'bf16' if device.type == 'cuda' else 'fp32'}, batch {args.batch} × seq {args.seq}, SDPA, "
        f"{args.steps} steps (median after {min(args.warmup, args.steps - 1)} warm-up), "
        f"FLOPs/token {fpt / 1e9 if fpt else float('nan'):.3g} G, peak "
        f"{'unknown' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'}.\n",
        bl.table(["activation checkpointing", "torch.compile", "ms/step", "tokens/s", "MFU", mem_label, "error"], rows),
    ]
    bl.record("7. GPU throughput and MFU", loads, "\n".join(body), key="gpu_mfu")
    print(json.dumps({"device": name, "peak_flops": peak, "flops_per_token": fpt, "batch": args.batch, "seq": args.seq,
                      "tokens_per_s": best["tokens_per_s"] if best else None, "mfu": best["mfu"] if best else None,
                      "results": results}), flush=True)


if __name__ == "__main__":
    main()
