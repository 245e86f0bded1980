"""A minimal FSDP2 fine-tuning loop for torchrun: the baseline trainlift's step time is compared with.

    torchrun --nproc-per-node 2 bench/torchrun_fsdp.py examples/tiny-local.yaml --steps 100 [--set key=value ...]

Same model, data, packing, micro-batch, sequence length, optimizer and loss as
`trainlift train` on the same spec; no Ray, no checkpoints, no evaluation, no
metrics sink. Prints one JSON line: median steady-state step time and tokens/s,
the threads each worker computes with, each worker's RSS before it loads data
and its peak RSS, and (when BENCH_T0 holds the launch time) the time to the
first optimizer step with a timestamp per start-up phase.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainlift.config.job import load_job_spec
from trainlift.train.data import examples as data
from trainlift.train.model.build import decoder_layers, materialize


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("spec")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="spec override a.b=c")
    marks = {"imports_done": time.time()}
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    marks["process_group"] = time.time()
    rss_before_data_mib = resident_mib()
    spec = load_job_spec(args.spec, args.overrides)
    if rank == 0 and spec.model.config is not None:
        materialize(spec.model.path, spec.model.config, spec.model.tokenizer, spec.train.seed)
    dist.barrier()
    tokenizer = AutoTokenizer.from_pretrained(spec.model.tokenizer or spec.model.path)
    marks["tokenizer"] = time.time()
    packed = data.prepare(spec.data.train, spec.data.format, tokenizer, spec.data.seq_len)
    marks["data_prepare"] = time.time()
    model = AutoModelForCausalLM.from_pretrained(spec.model.path, dtype=torch.float32)
    marks["model_load"] = time.time()
    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.train.lr, betas=(0.9, 0.95))
    marks["fsdp"] = time.time()

    mbs, step_ends, tokens = spec.train.micro_batch_size, [], []
    for step in range(args.steps):
        idx = data.global_indices(len(packed.rows), spec.train.seed, step * mbs * world, mbs * world)
        batch = data.collate([packed.rows[i] for i in data.rank_slice(idx, rank, world)])
        count = torch.tensor([float((batch["labels"][:, 1:] != -100).sum()), float(batch["num_tokens"])])
        dist.all_reduce(count)
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), batch["labels"][:, 1:].reshape(-1),
                               ignore_index=-100, reduction="sum")
        (loss * world / count[0]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.train.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        step_ends.append(time.time())
        tokens.append(float(count[1]))
    marks["first_step"] = step_ends[0]

    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    threads = {"torch_threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    gathered = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "peak_rss_mib": peak_rss_mib, "rss_before_data_mib": rss_before_data_mib,
                                      **threads})
    if rank == 0:
        periods = [b - a for a, b in zip(step_ends, step_ends[1:])][args.warmup:]
        steady_tokens = sum(tokens[args.warmup + 1:])
        t0 = float(os.environ["BENCH_T0"]) if "BENCH_T0" in os.environ else None
        print(json.dumps({
            "runner": "torchrun", "steps": args.steps, "world_size": world,
            "median_step_s": statistics.median(periods),
            "tokens_per_s": steady_tokens / sum(periods) if periods else None,
            "steady_window": [step_ends[args.warmup], step_ends[-1]],
            "workers": gathered,
            "time_to_first_step_s": step_ends[0] - t0 if t0 else None,
            "phases": {k: v - t0 for k, v in marks.items()} if t0 else None,
        }), flush=True)
    dist.destroy_process_group()


def resident_mib() -> float:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:")) / 1024


if __name__ == "__main__":
    main()
