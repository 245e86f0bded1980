"""A minimal FSDP2 fine-tuning loop for torchrun: the baseline trainlift's step time is compared with.

    torchrun --nproc-per-node 2 bench/torchrun_fsdp.py examples/tiny-local.yaml --steps 100

Same model, data, packing, micro-batch, sequence length, optimizer and loss as
`trainlift train` on the same spec; no Ray, no checkpoints, no metrics sink.
Prints one JSON line: median steady-state step time and tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainlift.config.job import load_job_spec
from trainlift.train import data
from trainlift.train.model import decoder_layers, materialize


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("spec")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    t_start = float(os.environ.get("BENCH_T0", time.time()))

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = load_job_spec(args.spec)
    if rank == 0 and spec.model.config is not None:
        materialize(spec.model.path, spec.model.config, spec.model.tokenizer, spec.train.seed)
    dist.barrier()
    tokenizer = AutoTokenizer.from_pretrained(spec.model.tokenizer or spec.model.path)
    packed = data.prepare(spec.data.train, spec.data.format, tokenizer, spec.data.seq_len)
    model = AutoModelForCausalLM.from_pretrained(spec.model.path, dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.train.lr, betas=(0.9, 0.95))

    mbs, times, first_step_at = spec.train.micro_batch_size, [], None
    for step in range(args.steps):
        t0 = time.perf_counter()
        idx = data.global_indices(len(packed.rows), spec.train.seed, step * mbs * world, mbs * world)
        batch = data.collate([packed.rows[i] for i in data.rank_slice(idx, rank, world)])
        count = torch.tensor([float((batch["labels"][:, 1:] != -100).sum())])
        dist.all_reduce(count)
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), batch["labels"][:, 1:].reshape(-1),
                               ignore_index=-100, reduction="sum")
        (loss * world / count).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.train.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - t0)
        if first_step_at is None:
            first_step_at = time.time()
    if rank == 0:
        steady = times[args.warmup:]
        print(json.dumps({"runner": "torchrun", "median_step_s": statistics.median(steady), "steps": args.steps,
                          "time_to_first_step_s": first_step_at - t_start}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
