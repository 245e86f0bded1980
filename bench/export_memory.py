"""Benchmark 20: host memory of each rank while the HF export is written, gathering every weight on every rank
(an all-gather, as trainlift's export did before) against gathering it to rank 0 only (what it does now).

    python bench/export_memory.py [--no-record]

Two gloo ranks under torch.distributed.run shard a ~100M-parameter Llama (random init from its config, fp32:
the recipe's build and FSDP2 sharding) and export it with `export.export_hf` to a local directory, once per
way, in alternating order. Each rank resets its peak resident memory (`/proc/self/clear_refs`, VmHWM) just before
an export and reads it just after; the figure is that peak less the resident memory before the export, as a
fraction of the model's fp32 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import benchlib as bl

LLAMA_100M = {"model_type": "llama", "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 8,
              "num_attention_heads": 12, "num_key_value_heads": 12, "vocab_size": 32000,
              "max_position_embeddings": 512, "tie_word_embeddings": False}
WAYS = ("all ranks gather (before)", "rank 0 gathers (now)")
ROUNDS = 2


def status_kib(field: str) -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field))


def gathered_everywhere(tensor):
    """The export's gather as it was: every rank all-gathers the whole tensor and copies it to the host."""
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu()


def worker(out: str) -> None:
    import pyarrow.fs as pafs
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from trainlift.config.job import ModelSection
    from trainlift.train.model import export, weights
    from trainlift.train.model.build import apply_fsdp, build_config, fill_weights

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tokenizer = AutoTokenizer.from_pretrained(bl.REPO / "examples" / "tiny" / "tokenizer")
    spec = ModelSection(config=LLAMA_100M, tokenizer=str(bl.REPO / "examples" / "tiny" / "tokenizer"))
    config = build_config(LLAMA_100M, tokenizer)
    model = apply_fsdp(weights.empty_model(config), torch.device("cpu"), bf16=False, activation_checkpointing=False)
    fill_weights(model, spec, 0, torch.device("cpu"))
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    original = export.full_tensor
    peaks: dict[str, list[float]] = {way: [] for way in WAYS}
    for round_ in range(ROUNDS):
        for way in (WAYS if round_ % 2 == 0 else WAYS[::-1]):
            export.full_tensor = gathered_everywhere if way == WAYS[0] else original
            dist.barrier()
            Path("/proc/self/clear_refs").write_text("5")
            before = status_kib("VmRSS:")
            export.export_hf(pafs.LocalFileSystem(), f"{out}/export-{round_}-{WAYS.index(way)}", model, config,
                             tokenizer, torch.float32)
            peaks[way].append((status_kib("VmHWM:") - before) * 1024 / model_bytes)
            dist.barrier()
    export.full_tensor = original
    Path(f"{out}/rank{rank}.json").write_text(json.dumps({"peaks": peaks, "model_bytes": model_bytes}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bl.add_common_args(parser)
    args = parser.parse_args()
    bl.configure(args)
    with tempfile.TemporaryDirectory(prefix="trainlift-bench-export-") as out:
        loads = [bl.wait_for_quiet()]
        env = bl.clean_env(OMP_NUM_THREADS="1", PYTHONPATH=str(bl.REPO / "src"))
        proc = subprocess.run([str(bl.BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", __file__,
                               "--worker", out], cwd=bl.REPO, env=env, capture_output=True, text=True, timeout=1200)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-3000:])
        ranks = [json.loads(Path(f"{out}/rank{r}.json").read_text()) for r in range(2)]
    model_mib = ranks[0]["model_bytes"] / 2**20
    rows = [[way] + [f"{max(r['peaks'][way]):.2f}" for r in ranks] + [f"{max(r['peaks'][way]) * model_mib:,.0f}"
                                                                      for r in ranks] for way in WAYS]
    before_mib, now_mib = (max(ranks[1]["peaks"][way]) * model_mib for way in WAYS)
    body = "\n".join([
        f"A ~100M-parameter Llama ({model_mib:,.0f} MiB of fp32 parameters), sharded over 2 gloo ranks, exported "
        f"{ROUNDS} times each way in alternating order; the worst of the rounds per rank (peak resident memory "
        "during the export less what the rank held before it).\n",
        bl.table(["way", "rank 0 peak / model bytes", "rank 1 peak / model bytes", "rank 0 MiB", "rank 1 MiB"],
                 rows),
        f"\nRank 1's peak during the export went from {before_mib:,.0f} MiB to **{now_mib:,.0f} MiB**: it sends its "
        "shards and holds nothing whole. Rank 0 holds one whole tensor at a time (the largest, the 32000 x 768 "
        "embedding or LM head, is 94 MiB) and what the writing buffers around it.",
    ])
    bl.record("20. Export: host memory per rank", loads, body, key="export_memory")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        main()
