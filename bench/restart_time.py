"""Benchmark 16: how long a full fine-tune takes to restart from a checkpoint, reading the base model's weights
first (as trainlift did before) or only the checkpoint.

    python bench/restart_time.py [--rounds 3] [--no-record]

A ~100M-parameter Llama (fp32, untied head) is saved with `save_pretrained`, trained one step and checkpointed
with the recipe's own code. Each measured restart is a fresh Python process on one gloo rank that runs the
recipe's `build_model` and `resume` and then one training step: `base + checkpoint` builds with
`resume_from=None` (the weights are read from model.path, then overwritten by the checkpoint), `checkpoint only`
with the checkpoint's path (what `train_loop_per_worker` does now). Time runs from just before the process is
started to the end of its first step. The two ways alternate, the order rotated every round. Before each
restart the base and checkpoint files are dropped from the page cache (`posix_fadvise(DONTNEED)` on those
files only), so both are read from the local disk, as on a node that has not read them yet; model.path on
network storage or the hub makes the base read dearer than here.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchlib as bl

LLAMA_100M = {"model_type": "llama", "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 8,
              "num_attention_heads": 12, "num_key_value_heads": 12, "vocab_size": 32000,
              "max_position_embeddings": 512, "tie_word_embeddings": False}
WAYS = {"base + checkpoint": "base", "checkpoint only": "checkpoint"}
WAYS_ORDER = list(WAYS)
SEQ = 64


def worker(model_dir: str, run_dir: str):
    """The recipe's `Worker` for rank 0 of 1 (gloo), its run directory `run_dir`."""
    import pyarrow.fs as pafs
    import torch
    import torch.distributed as dist

    from trainlift.config.job import load_job_spec
    from trainlift.train.recipe import Worker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    spec = load_job_spec(bl.REPO / bl.DEMO_SPEC, [f"model.path={model_dir}", "model.attn_implementation=sdpa"])
    return Worker(spec, 0, 1, torch.device("cpu"), False, pafs.LocalFileSystem(), run_dir)


def one_step(model, optimizer, scheduler, w) -> float:
    import torch

    from trainlift.train import recipe
    from trainlift.train.data import examples as data

    ids = torch.randint(0, LLAMA_100M["vocab_size"], (SEQ,), generator=torch.Generator().manual_seed(0)).tolist()
    batch = data.collate([{"input_ids": ids, "labels": ids, "position_ids": list(range(SEQ))}])
    return recipe.train_step(model, optimizer, scheduler, [batch], 1.0, 1, w.device).loss


def child_setup(model_dir: str, run_dir: str) -> None:
    """Save the model, train it one step and write a complete checkpoint the restarts resume from."""
    import torch

    from trainlift.train import recipe
    from trainlift.train.model.build import build_config
    from trainlift.train.run import checkpoint
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(build_config(LLAMA_100M)).save_pretrained(model_dir)
    w = worker(model_dir, run_dir)
    model, _, _ = recipe.build_model(w)
    optimizer, scheduler = recipe.build_optimizer(model, w)
    one_step(model, optimizer, scheduler, w)
    path = f"{run_dir}/{checkpoint.dir_name(1)}"
    checkpoint.write_shard(path, model, optimizer, scheduler, 1, 0, 0, 1)
    checkpoint.mark_complete(w.fs, path, 1, 1)
    params = sum(p.numel() for p in model.parameters())
    size = sum(f.stat().st_size for f in Path(path).iterdir())
    print(json.dumps({"params": params, "checkpoint_bytes": size,
                      "base_bytes": sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))}))


def child_restart(model_dir: str, run_dir: str, way: str) -> None:
    """One restart; prints the wall-clock time at the end of each phase."""
    from trainlift.train import recipe
    from trainlift.train.run import checkpoint

    marks = {"imported": time.time()}
    w = worker(model_dir, run_dir)
    latest = checkpoint.latest_complete(w.fs, run_dir)
    model, _, _ = recipe.build_model(w, resume_from=latest[1] if way == "checkpoint" else None)
    marks["built"] = time.time()
    optimizer, scheduler = recipe.build_optimizer(model, w)
    step, _, _ = recipe.resume(w.fs, run_dir, latest, model, optimizer, scheduler, 0)
    marks["resumed"] = time.time()
    loss = one_step(model, optimizer, scheduler, w)
    marks["stepped"] = time.time()
    print(json.dumps({"marks": marks, "step": step, "loss": loss}))


def run_child(*args: str) -> dict:
    env = bl.clean_env(OMP_NUM_THREADS="2")
    done = subprocess.run([sys.executable, __file__, "--child", *args], env=env, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def evict_from_page_cache(*directories: str) -> None:
    for directory in directories:
        for path in Path(directory).rglob("*"):
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def restart(model_dir: str, run_dir: str, way: str) -> dict:
    evict_from_page_cache(model_dir, run_dir)
    started = time.time()
    result = run_child("restart", model_dir, run_dir, way)
    marks = result["marks"]
    return {"total": marks["stepped"] - started, "import": marks["imported"] - started,
            "build": marks["built"] - marks["imported"], "resume": marks["resumed"] - marks["built"],
            "step": marks["stepped"] - marks["resumed"], "loss": result["loss"]}


def report(setup: dict, runs: dict[str, list[dict]]) -> str:
    med = {way: {k: bl.median([r[k] for r in rs]) for k in ("total", "import", "build", "resume", "step")}
           for way, rs in runs.items()}
    rows = [[way, f"{m['total']:.2f}", " ".join(f"{r['total']:.1f}" for r in runs[way]), f"{m['import']:.2f}",
             f"{m['build']:.2f}", f"{m['resume']:.2f}", f"{m['step']:.2f}"] for way, m in med.items()]
    old, new = med["base + checkpoint"], med["checkpoint only"]
    losses = {way: sorted({round(r["loss"], 6) for r in rs}) for way, rs in runs.items()}
    spread = max(max(r["total"] for r in rs) - min(r["total"] for r in rs) for rs in runs.values())
    base, ckpt = setup["base_bytes"] / 2**20, setup["checkpoint_bytes"] / 2**20
    return (f"Llama, {setup['params'] / 1e6:.0f}M parameters (fp32, untied head): base safetensors {base:.0f} MiB, "
            f"checkpoint (model + AdamW state) {ckpt:.0f} MiB on local disk; 1 gloo rank, {len(runs[WAYS_ORDER[0]])} "
            f"restarts each, medians. `import` is the interpreter's start and the imports of torch, transformers "
            f"and the recipe, `build` `recipe.build_model` (with the base read in the first way), `resume` the "
            f"checkpoint load, `first step` one step of {SEQ} tokens.\n\n"
            + bl.table(["restart", "median s", "runs s", "import s", "build s", "resume s", "first step s"], rows)
            + f"\n\nWithout the base read, `build` takes {new['build']:.2f} s instead of {old['build']:.2f} s: "
              f"{old['build'] - new['build']:.2f} s saved on {base:.0f} MiB that no longer have to be read, "
              f"{100 * base / (base + ckpt):.0f}% of what a restart read. The whole restart: {new['total']:.2f} s "
              f"against {old['total']:.2f} s, with a run-to-run spread of up to {spread:.1f} s on this machine. "
              f"From local disk the base read is cheap; from network storage or the hub, and for larger models, it "
              f"costs in proportion, and a restart now needs model.path not at all. The first step's loss is the "
              f"same either way ({losses['base + checkpoint']} vs {losses['checkpoint only']}).\n")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        {"setup": child_setup, "restart": child_restart}[sys.argv[2]](*sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    bl.add_common_args(parser)
    args = parser.parse_args()
    bl.configure(args)
    with tempfile.TemporaryDirectory(prefix="trainlift-restart-") as tmp:
        model_dir, run_dir = os.path.join(tmp, "model"), os.path.join(tmp, "run")
        setup = run_child("setup", model_dir, run_dir)
        loads, runs = [], {way: [] for way in WAYS}
        for n in range(args.rounds):
            for way in WAYS_ORDER[n % 2:] + WAYS_ORDER[:n % 2]:
                loads.append(bl.wait_for_quiet())
                runs[way].append(restart(model_dir, run_dir, WAYS[way]))
                print(way, json.dumps(runs[way][-1]), file=sys.stderr, flush=True)
    bl.record("16. Restart time of a full fine-tune", loads, report(setup, runs), key="restart_time")


if __name__ == "__main__":
    main()
