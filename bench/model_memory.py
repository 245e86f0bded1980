"""Host memory of loading, exporting and the loss, the old way against the new, each pair measured in one run.

  load    a ~134M-parameter Llama saved as bf16 safetensors (as published models are) and trained in fp32, 4 CPU workers (torchrun, gloo): each worker's
          peak memory while it loads the model and shards it. Old: `from_pretrained` on every rank, then
          `fully_shard`. New: meta device, `fully_shard`, fill the shards from the files (`train.weights`).
  export  the same model, 2 workers: rank 0's peak memory minus rank 1's while writing the HF export.
          Old: gather the full state dict to rank 0, build a model from it, `save_pretrained`.
          New: `train.export.export_hf` (streamed tensor by tensor).
  loss    one forward + backward at vocabulary 151,936, seq 2048, micro-batch 1 (1 layer, hidden 64):
          the plain loss on full logits vs `train.loss.token_loss_sum` (chunked), one process each.

Peaks are per process and per phase: the kernel's high-water mark (VmHWM) is reset through
/proc/self/clear_refs before the phase, so "peak" is VmHWM after minus VmRSS before; "anon" is the
same for anonymous memory (sampled every 2 ms), which leaves out the pages of memory-mapped
safetensors files (shared page cache, not the process's own).

  python bench/model_memory.py [load export loss] [--pairs N] [--no-record]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

LLAMA_134M = {"model_type": "llama", "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
              "num_attention_heads": 12, "num_key_value_heads": 12, "vocab_size": 32000,
              "max_position_embeddings": 2048, "tie_word_embeddings": False}
LOSS_MODEL = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 151936,
              "max_position_embeddings": 2048, "tie_word_embeddings": False}
MIB = 2**20


def status_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class PhasePeak:
    """Peak memory of this process during a `with` block, above what it held when the block began."""

    def __enter__(self):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current VmRSS
        self.rss0, self.anon0, self.anon_peak = status_kib("VmRSS"), status_kib("RssAnon"), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.anon_peak = max(self.anon_peak, status_kib("RssAnon"))
            self._stop.wait(0.002)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.anon_peak = max(self.anon_peak, status_kib("RssAnon"))
        self.peak = (status_kib("VmHWM") - self.rss0) * 1024
        self.anon = (self.anon_peak - self.anon0) * 1024
        return False


# --- what runs inside a torchrun worker -------------------------------------------------------------

def old_load(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    from trainlift.train.model.build import apply_fsdp

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return apply_fsdp(model, torch.device("cpu"), bf16=False, activation_checkpointing=False)


def new_load(model_dir: str):
    import torch

    from trainlift.config.job import ModelSection
    from trainlift.train.model import weights
    from trainlift.train.model.build import apply_fsdp, fill_weights, sharded_config

    spec = ModelSection(path=model_dir)
    model = apply_fsdp(weights.empty_model(sharded_config(spec)), torch.device("cpu"), False, False)
    return fill_weights(model, spec, 0, torch.device("cpu"))


def old_export(model, out_dir: str, rank: int) -> None:
    """The export as it was: the whole state dict gathered to rank 0, a model built from it, save_pretrained."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        plain = AutoModelForCausalLM.from_config(model.config)
        plain.load_state_dict(full)
        plain.to(torch.float32).save_pretrained(out_dir, safe_serialization=True)


def new_export(model, out_dir: str, rank: int) -> None:
    import pyarrow.fs as pafs
    import torch

    from trainlift.train.model.export import model_weights, write_weights

    write_weights(pafs.LocalFileSystem(), out_dir, model_weights(model), torch.float32)


def worker(args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = new_load if args.variant == "new" or args.worker == "export" else old_load
    # Library code is not load memory: it is the same for any model size, so both ways import it before the
    # phase starts (the recipe's own imports, and the modeling code of the benchmark's architecture, about
    # 44 MiB per process, which either way's first model construction would otherwise import inside the phase).
    import safetensors.torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import transformers  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    import trainlift.train.model.build  # noqa: F401
    import trainlift.train.model.weights  # noqa: F401
    dist.barrier()
    with PhasePeak() as load_peak:
        model = loader(args.model_dir)
        dist.barrier()
    result = {"rank": rank, "load_peak": load_peak.peak, "load_anon": load_peak.anon}
    if args.worker == "export":
        exporter = new_export if args.variant == "new" else old_export
        with tempfile.TemporaryDirectory(prefix="bench-export-") as out:
            dist.barrier()
            with PhasePeak() as export_peak:
                exporter(model, out, rank)
                dist.barrier()
        result.update(export_peak=export_peak.peak, export_anon=export_peak.anon)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(args.out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def loss_worker(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from trainlift.train.model.loss import plain_token_loss_sum, token_loss_sum
    from trainlift.train.model.build import build_config

    torch.manual_seed(0)
    config = build_config(LOSS_MODEL)
    model = AutoModelForCausalLM.from_config(config).float()
    ids = torch.randint(0, config.vocab_size, (1, 2048))
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(2048)[None]}
    with PhasePeak() as peak:
        if args.variant == "old":
            logits = model(input_ids=ids, position_ids=batch["position_ids"], use_cache=False).logits
            loss = plain_token_loss_sum(logits, batch["labels"])
            del logits
        else:
            loss = token_loss_sum(model, batch)
        loss.backward()
    Path(args.out).write_text(json.dumps([{"peak": peak.peak, "anon": peak.anon, "loss": loss.item(),
                                           "grad_norm": float(torch.nn.utils.get_total_norm(
                                               [p.grad for p in model.parameters()]))}]))


# --- the driver ---------------------------------------------------------------------------------------

def build_model(workdir: Path) -> tuple[str, int]:
    import torch
    from transformers import AutoModelForCausalLM

    from trainlift.train.model.build import build_config

    path = workdir / "llama-134m-bf16"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(build_config(LLAMA_134M)).to(torch.bfloat16)
        model.save_pretrained(path, max_shard_size="100MB")
    bf16_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return str(path), 2 * bf16_bytes  # the model's fp32 bytes, as the workers hold it


def run_variant(what: str, variant: str, model_dir: str, workers: int) -> list[dict]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, "PYTHONPATH": str(benchlib.REPO / "src"), "OMP_NUM_THREADS": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        me = [str(Path(__file__).resolve()), "--worker", what, "--variant", variant, "--out", out.name,
              "--model-dir", model_dir]
        if what == "loss":
            cmd = [sys.executable, *me]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(workers), *me]
        subprocess.run(cmd, env=env, check=True)
        return json.loads(Path(out.name).read_text())


def mib(nbytes: float) -> str:
    return f"{nbytes / MIB:,.0f}"


def bench_load(model_dir: str, model_bytes: int, pairs: int, loads: list) -> str:
    rows, sums = [], {"old": [], "new": []}
    for pair in range(1, pairs + 1):
        for variant in ("old", "new"):
            loads.append(benchlib.wait_for_quiet())
            result = sorted(run_variant("load", variant, model_dir, 4), key=lambda r: r["rank"])
            total_peak, total_anon = sum(r["load_peak"] for r in result), sum(r["load_anon"] for r in result)
            sums[variant].append((total_peak, total_anon))
            rows.append([pair, variant, ", ".join(mib(r["load_peak"]) for r in result),
                         ", ".join(mib(r["load_anon"]) for r in result),
                         f"{total_peak / model_bytes:.2f}", f"{total_anon / model_bytes:.2f}"])
    old = benchlib.median([p for p, _ in sums["old"]])
    new = benchlib.median([p for p, _ in sums["new"]])
    new_anon = benchlib.median([a for _, a in sums["new"]])
    return (f"Llama architecture, 134M parameters saved as bf16 safetensors in 100 MB files, loaded as fp32 "
            f"({mib(model_bytes)} MiB; hidden 768, 12 layers, vocabulary 32,000, untied), 4 CPU workers under torchrun (gloo), one thread each. Per-worker peak memory "
            f"above what the worker held before loading (MiB), and the sum over the 4 workers as a fraction "
            f"of the model's fp32 bytes.\n\n"
            + benchlib.table(["pair", "way", "peak per worker MiB", "anon peak per worker MiB",
                              "sum peak / model", "sum anon / model"], rows)
            + f"\n\n**new / old = {new / old:.2f}** (sum of peaks, medians). Sum over the node's workers: "
            f"{new / model_bytes:.2f}× the model's bytes counting the mapped file pages each worker read, "
            f"{new_anon / model_bytes:.2f}× counting only its own (anonymous) memory; target ≤ 1.3×. Library code "
            f"(transformers, DCP and the Llama modeling code) is imported before the phase both ways.\n")


def bench_export(model_dir: str, model_bytes: int, pairs: int, loads: list) -> str:
    rows, gaps = [], {"old": [], "new": []}
    for pair in range(1, pairs + 1):
        for variant in ("old", "new"):
            loads.append(benchlib.wait_for_quiet())
            r0, r1 = sorted(run_variant("export", variant, model_dir, 2), key=lambda r: r["rank"])
            gap = r0["export_peak"] - r1["export_peak"]
            gaps[variant].append(gap)
            rows.append([pair, variant, mib(r0["export_peak"]), mib(r1["export_peak"]), mib(gap),
                         f"{gap / model_bytes:.2f}"])
    old, new = benchlib.median(gaps["old"]), benchlib.median(gaps["new"])
    return (f"The same model ({mib(model_bytes)} MiB in fp32), loaded the new way on 2 CPU workers, then exported as fp32 "
            f"safetensors to a local directory. Peak memory during the export above what each worker held "
            f"before it (MiB).\n\n"
            + benchlib.table(["pair", "way", "rank 0 MiB", "rank 1 MiB", "rank 0 − rank 1 MiB",
                              "(rank 0 − rank 1) / model"], rows)
            + f"\n\n**Rank 0's extra memory: old {old / model_bytes:.2f}×, new {new / model_bytes:.2f}× the "
            f"model's bytes** (medians; target ≤ 0.25).\n")


def bench_loss(pairs: int, loads: list) -> str:
    rows, peaks = [], {"old": [], "new": []}
    for pair in range(1, pairs + 1):
        for variant in ("old", "new"):
            loads.append(benchlib.wait_for_quiet())
            (r,) = run_variant("loss", variant, "", 1)
            peaks[variant].append(r["peak"])
            rows.append([pair, variant, mib(r["peak"]), mib(r["anon"]), f"{r['loss']:.6f}", f"{r['grad_norm']:.6f}"])
    old, new = benchlib.median(peaks["old"]), benchlib.median(peaks["new"])
    return ("One forward + backward, fp32 on the CPU, vocabulary 151,936, seq 2048, micro-batch 1, a 1-layer "
            "Llama of hidden size 64 (its full fp32 logits: 1,187 MiB). Peak memory of the step above what the "
            "process held before it (MiB); loss and gradient norm show both ways compute the same thing.\n\n"
            + benchlib.table(["pair", "loss", "peak MiB", "anon peak MiB", "loss sum", "grad norm"], rows)
            + f"\n\n**new / old = {new / old:.2f}** ({mib(old)} → {mib(new)} MiB, medians).\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", nargs="*", help="load, export and/or loss (default: all three)")
    parser.add_argument("--pairs", type=int, default=2, help="old/new pairs per benchmark, run alternately")
    parser.add_argument("--workdir", default=None, help="where the benchmark model is saved (default: a temp dir)")
    parser.add_argument("--worker", choices=["load", "export", "loss"], help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=["old", "new"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    benchlib.add_common_args(parser)
    args = parser.parse_args()
    if args.worker:
        return loss_worker(args) if args.worker == "loss" else worker(args)
    args.what = args.what or ["load", "export", "loss"]
    if set(args.what) - {"load", "export", "loss"}:
        parser.error(f"unknown benchmark {', '.join(sorted(set(args.what) - {'load', 'export', 'loss'}))}")
    benchlib.configure(args)
    with tempfile.TemporaryDirectory(prefix="bench-model-") as tmp:
        workdir = Path(args.workdir or tmp)
        model_dir, model_bytes = build_model(workdir) if {"load", "export"} & set(args.what) else ("", 0)
        titles = {"load": "8. Model load memory", "export": "9. Export memory", "loss": "10. Loss memory"}
        for what in args.what:
            loads: list = []
            started = time.monotonic()
            body = (bench_load(model_dir, model_bytes, args.pairs, loads) if what == "load" else
                    bench_export(model_dir, model_bytes, args.pairs, loads) if what == "export" else
                    bench_loss(args.pairs, loads))
            print(f"{what}: {time.monotonic() - started:.0f} s", file=sys.stderr)
            benchlib.record(titles[what], loads, body, key=f"model_memory_{what}")


if __name__ == "__main__":
    main()
