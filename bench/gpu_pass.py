"""The prepared GPU pass: trainlift's own recipe on one GPU, without Ray, in one command of at most 8 minutes.

    bash bench/gpu_pass.sh --out DIR            # on a machine with one H100/H200 (see the header of that script)
    bash bench/gpu_pass.sh --smoke --out DIR    # toy sizes on the CPU, as the test suite runs it

Stages, each fault-isolated (a failing stage records its error and traceback; the rest still run):

  doctor        what `trainlift doctor --json` reports, from probe() and stack_rules() in this process
  packed        every attention kernel that loads here (flash_attention_2, flex_attention, sdpa) at head_dim 128
                on a micro-batch of two packed rows, through the recipe's model inputs: logits against each
                example run alone, and one backward (flex's needs ~131 KB of shared memory a block)
  tiny_recipe   the demo model of examples/tiny-local.yaml built, trained for 50 steps by recipe.train (bf16,
                NCCL, world 1), exported by recipe.export_run; the export loaded with from_pretrained (fp32) must
                give the trained model's next tokens (argmax agreement) within a relative logit tolerance
  nccl          with two or more GPUs, one rank per GPU: a 256 MiB all-reduce, NCCL_DEBUG=INFO to a file, that
                file classified by trainlift.doctor.nccl_log; with one GPU, recorded as not measured (NCCL
                refuses two ranks on one device, and a world of one moves nothing)
  checkpoint    how long the loop is blocked per checkpoint of the 1.5B model: checkpoint.write_shard, the copy
                to run storage that ray.train.report makes, mark_complete and prune
  qwen15b       the Qwen2.5-1.5B architecture (random init) at seq 2048 on packed rows (restarting position ids,
                prompts masked): recipe.build_model, recipe.train; the largest micro-batch that fits, with
                activation checkpointing off/on and torch.compile off/on: tokens/s, MFU, peak memory
  qwen15b_lora  the same with model.lora (r 16, all-linear), activation checkpointing on, compile off

The correctness stages come first and the throughput ones, which fill what is left of the budget, last: a pass cut
short keeps the findings.

With --smoke: CPU, gloo, fp32, the tiny Qwen2 config of bench/gpu_mfu.py for the throughput stages, 3 recipe
steps, the compile combinations traced by Dynamo with the eager backend, a 64 KiB all-reduce over two CPU ranks.

Writes DIR/gpu_pass.json (every figure; rewritten after each stage, so a run cut short keeps what it measured)
and DIR/gpu_pass.md, a section for docs/BENCHMARKS.md. Exits 1 when a stage failed.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import os
import platform
import resource
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import benchlib as bl
from gpu_mfu import QWEN25_15B, TINY, init_single_process_group

STARTED = time.monotonic()
REPO = bl.REPO
DEMO_SPEC = REPO / bl.DEMO_SPEC
TOKENIZER = REPO / "examples" / "tiny" / "tokenizer"
STAGES = ("doctor", "packed", "tiny_recipe", "nccl", "checkpoint", "qwen15b", "qwen15b_lora")
LORA = {"r": 16, "target_modules": "all-linear"}
NCCL_LOG = "nccl_debug.log"
LOG_HEAD_LINES = 40


@dataclass(frozen=True)
class Sizes:
    recipe_steps: int
    recipe_examples: int | None  # training examples read for tiny_recipe (None: the whole file)
    model_config: dict
    seq: int
    micro_batches: tuple[int, ...]  # tried largest first until one fits
    warmup: int
    timed: int
    compile_backend: str
    checkpoint_repeats: int
    allreduce_bytes: int
    export_tolerance: float  # max |logits difference| between the trained model and its export, over max |logit|
    min_combination_s: float  # a throughput combination does not start with less time left


FULL = Sizes(recipe_steps=50, recipe_examples=None, model_config=QWEN25_15B, seq=2048, micro_batches=(8, 4, 2, 1),
             warmup=3, timed=5, compile_backend="inductor", checkpoint_repeats=2, allreduce_bytes=256 * 2**20,
             export_tolerance=0.02, min_combination_s=50.0)
SMOKE = Sizes(recipe_steps=3, recipe_examples=400, model_config=TINY, seq=128, micro_batches=(4, 2),
              warmup=1, timed=2, compile_backend="eager", checkpoint_repeats=2, allreduce_bytes=64 * 2**10,
              export_tolerance=1e-5, min_combination_s=0.0)


class Pass:
    """The run's device, sizes, output directory, time budget and results."""

    def __init__(self, args, device):
        self.args, self.device, self.smoke = args, device, args.smoke
        self.sizes = SMOKE if args.smoke else FULL
        self.out = Path(args.out).resolve()
        self.deadline = STARTED + args.budget_s
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu-pass-"))
        self.started = datetime.datetime.now(datetime.timezone.utc)
        self.stages: dict[str, dict] = {}
        self.packed_cache: dict = {}

    @property
    def dtype(self) -> str:
        return "bf16" if self.device.type == "cuda" else "fp32"

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run_dir(self, name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.tmp))


# --- shared pieces


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device) -> None:
    import torch

    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()  # compiled code can keep the last model alive
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def reset_peak_memory(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device) -> float:
    """Peak GPU memory allocated since the last reset; on the CPU, the process's peak resident set."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def is_out_of_memory(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def error_text(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:300]}"


def make_worker(ctx: Pass, spec, name: str):
    """The recipe's Worker for rank 0 of a world of one, its run directory on the local disk."""
    from pyarrow import fs as pafs

    from trainlift.train.recipe import Worker

    return Worker(spec, rank=0, world=1, device=ctx.device, bf16=spec.model.dtype == "bf16",
                  fs=pafs.LocalFileSystem(), run_path=str(ctx.run_dir(name)))


def metric_rows(run_path: str) -> list[dict]:
    lines = (Path(run_path) / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if "step_time_s" in row]


def recipe_run(w, model, optimizer, scheduler, train_data, fpt, eval_data=None) -> dict:
    """recipe.train from step 0, driven as train_loop_per_worker drives it less what needs Ray: no progress
    board, and no evaluation or checkpoint boundaries inside the loop (those report to Ray Train)."""
    from trainlift.train import recipe
    from trainlift.train.model import lora

    log = recipe.RunLog(w, None, 0, fpt)
    evaluator = recipe.Evaluator(model, eval_data, w, log)
    initial_eval = evaluator(0)
    log.started(0, None, lora.parameter_counts(model))
    step, loss, _ = recipe.train(w, model, optimizer, scheduler, train_data, 0, 0, evaluator, log,
                                 recipe.StopRequests(None, 0), None)
    final_eval = evaluator(step)
    throughput = log.throughput(step)
    log.close({"finished": True, "steps": step, "final_loss": loss, **throughput})
    return {"rows": metric_rows(w.run_path), "initial_eval_loss": initial_eval, "eval_loss": final_eval,
            "recipe_throughput": throughput}


# --- 1. doctor


def stage_doctor(ctx: Pass) -> dict:
    from trainlift.doctor.probe import probe
    from trainlift.doctor.rules import has_errors, sort_findings, stack_rules

    facts = probe()
    findings = sort_findings(stack_rules(facts))
    return {"facts": facts.to_dict(), "findings": [f.to_dict() for f in findings], "ok": not has_errors(findings),
            "ray_loaded": sys.modules.get("ray") is not None}


# --- 2. the demo model through the recipe


def tiny_spec(ctx: Pass, base_dir: Path):
    from trainlift.config.job import load_job_spec

    return load_job_spec(DEMO_SPEC, [
        f"model.path={base_dir}", f"model.tokenizer={TOKENIZER}", f"model.dtype={ctx.dtype}",
        f"data.train={REPO / 'examples/data/tasks-train.jsonl'}", f"data.eval={REPO / 'examples/data/tasks-eval.jsonl'}",
        f"train.steps={ctx.sizes.recipe_steps}", f"train.warmup_steps={min(5, ctx.sizes.recipe_steps // 10)}",
        "train.eval_every=0", "checkpoint.every_steps=0", "scaling.workers=1", "data.eval_examples=64"])


EXPORT_ARGMAX_AGREEMENT = 0.99  # share of positions whose next token the export must predict as the trained model does


def export_agreement(w, model, batch: dict) -> dict:
    """The trained (sharded) model against its export, loaded in fp32 with the default kernel, on `batch`: max
    |logits difference|, that over max |logit| (bf16 training rounds every logit, so only a relative figure is
    comparable), and the share of positions whose argmax agrees."""
    import torch
    from transformers import AutoModelForCausalLM

    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    exported = AutoModelForCausalLM.from_pretrained(f"{w.run_path}/final", dtype=torch.float32).to(w.device).eval()
    model.eval()
    with torch.no_grad():
        trained_logits = model(**inputs).logits.float()
        exported_logits = exported(**inputs).logits.float()
    model.train()
    diff = float((trained_logits - exported_logits).abs().max())
    return {"export_logits_max_abs_diff": diff,
            "export_relative_diff": diff / max(float(trained_logits.abs().max()), 1e-12),
            "export_argmax_agreement": float((trained_logits.argmax(-1) == exported_logits.argmax(-1)).float().mean())}


def stage_tiny_recipe(ctx: Pass) -> dict:
    from trainlift.train import recipe
    from trainlift.train.data import examples as data
    from trainlift.train.model.build import load_tokenizer, materialize

    spec = tiny_spec(ctx, ctx.run_dir("tiny-base"))
    materialize(spec.model.path, spec.model.config, spec.model.tokenizer, spec.train.seed)
    tokenizer = load_tokenizer(spec.model)
    train_data = data.prepare(spec.data.train, spec.data.format, tokenizer, spec.data.seq_len,
                              limit=ctx.sizes.recipe_examples)
    eval_data = data.prepare(spec.data.eval, spec.data.format, tokenizer, spec.data.seq_len,
                             limit=spec.data.eval_examples)
    w = make_worker(ctx, spec, "tiny-run")
    model, model_config, fpt = recipe.build_model(w)
    optimizer, scheduler = recipe.build_optimizer(model, w)
    run = recipe_run(w, model, optimizer, scheduler, train_data, fpt, eval_data)
    recipe.export_run(w, model, model_config, tokenizer)
    batch = recipe.step_batches(train_data, spec, 0, 0, 1, w.device)[0]
    export = export_agreement(w, model, batch)
    losses = [row["loss"] for row in run["rows"]]
    return {"steps": len(losses), "dtype": spec.model.dtype, "first_loss": losses[0], "last_loss": losses[-1],
            "initial_eval_loss": run["initial_eval_loss"], "eval_loss": run["eval_loss"],
            "loss_fell": run["eval_loss"] < run["initial_eval_loss"] and losses[-1] < losses[0],
            **export, "export_tolerance": ctx.sizes.export_tolerance,
            "export_matches": export["export_relative_diff"] <= ctx.sizes.export_tolerance
            and export["export_argmax_agreement"] >= EXPORT_ARGMAX_AGREEMENT, **run["recipe_throughput"]}


# --- 3 and 4. the 1.5B model: throughput, MFU, memory


def synthetic_spec(ctx: Pass, micro_batch: int, ac: bool, lora: dict | None, steps: int):
    from trainlift.config.job import JobSpec

    return JobSpec.model_validate({
        "model": {"config": dict(ctx.sizes.model_config), "tokenizer": str(TOKENIZER), "dtype": ctx.dtype,
                  "activation_checkpointing": ac, "lora": lora},
        "data": {"train": "synthetic", "seq_len": ctx.sizes.seq},
        "train": {"steps": steps, "micro_batch_size": micro_batch, "lr": 1e-5, "warmup_steps": 0},
        "scaling": {"workers": 1}, "checkpoint": {"every_steps": 0}})


def synthetic_packed(ctx: Pass):
    """Rows packed by the project's own packing from random examples of 1/16 to 1/3 of a row, each with a
    masked (IGNORE) prompt of 20-60% of its tokens: several examples per row, position ids restarting."""
    if "rows" not in ctx.packed_cache:
        import numpy as np

        from trainlift.train.data import examples as data

        rng = np.random.default_rng(0)
        seq, vocab = ctx.sizes.seq, ctx.sizes.model_config["vocab_size"]
        need = max(ctx.sizes.micro_batches) * (ctx.sizes.warmup + ctx.sizes.timed) * seq
        found, total = [], 0
        while total < need:
            n = int(rng.integers(seq // 16, seq // 3))
            ids = rng.integers(0, vocab, n).tolist()
            prompt = int(n * rng.uniform(0.2, 0.6))
            found.append(data.Example(ids, [data.IGNORE] * prompt + ids[prompt:]))
            total += n
        ctx.packed_cache["rows"] = data.pack(found, seq, pad_id=0)
    return ctx.packed_cache["rows"]


def compile_layers(model, backend: str) -> int:
    """torch.compile the forward of each layer apply_fsdp sharded on its own (the decoder layers), after
    sharding: FSDP2's hooks, on the module call, stay outside the compiled code. Returns how many."""
    import torch
    from torch._dynamo.utils import counters
    from torch.distributed.fsdp import FSDPModule

    torch._dynamo.reset()
    counters.clear()
    layers = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    for layer in layers:
        layer.forward = torch.compile(layer.forward, backend=backend, dynamic=False)
    return len(layers)


def compile_counts(compiled: bool) -> dict:
    """What Dynamo did since compile_layers: frames compiled (one when every layer reuses the first layer's
    code, more on recompiles) and graph breaks (parts left to eager)."""
    if not compiled:
        return {}
    from torch._dynamo.utils import counters

    return {"dynamo_frames": counters["frames"].get("ok", 0),
            "dynamo_graph_breaks": sum(counters["graph_break"].values())}


def throughput(rows: list[dict], warmup: int, peak: float | None) -> dict:
    """Over the steps after `warmup`, from the recipe's own metrics rows: tokens are the real (non-padding)
    tokens of a step, as the recipe counts them, and FLOPs per token the step's own (attention over the packed
    examples' lengths, not the row's)."""
    from trainlift.train.run import metrics

    timed = rows[warmup:]
    tokens_per_s = sum(r["tokens"] for r in timed) / sum(r["step_time_s"] for r in timed)
    fpt = sum(r["tokens"] * r["flops_per_token"] for r in timed) / sum(r["tokens"] for r in timed)
    return {"step_s": statistics.median(r["step_time_s"] for r in timed), "first_step_s": rows[0]["step_time_s"],
            "tokens_per_step": statistics.median(r["tokens"] for r in timed), "tokens_per_s": tokens_per_s,
            "flops_per_token": fpt, "mfu": metrics.mfu(tokens_per_s, fpt, peak), "losses": [r["loss"] for r in rows]}


def measure(ctx: Pass, micro_batch: int, ac: bool, compiled: bool, lora: dict | None) -> dict:
    """One micro-batch size of one combination, built and stepped by the recipe."""
    from trainlift.train import recipe
    from trainlift.train.run import metrics

    spec = synthetic_spec(ctx, micro_batch, ac, lora, ctx.sizes.warmup + ctx.sizes.timed)
    w = make_worker(ctx, spec, "throughput")
    reset_peak_memory(ctx.device)
    t0 = time.perf_counter()
    model, _, fpt = recipe.build_model(w)
    build_s = time.perf_counter() - t0
    compiled_layers = compile_layers(model, ctx.sizes.compile_backend) if compiled else 0
    optimizer, scheduler = recipe.build_optimizer(model, w)
    run = recipe_run(w, model, optimizer, scheduler, synthetic_packed(ctx), fpt)
    result = throughput(run["rows"], ctx.sizes.warmup, metrics.device_peak_flops(ctx.device))
    return {**result, "build_s": build_s, "peak_memory_gib": peak_memory_gib(ctx.device),
            "predicted_gib": predicted_allocated_gib(spec, ctx.device),
            "compiled_layers": compiled_layers, **compile_counts(compiled)}


def predicted_allocated_gib(spec, device) -> float:
    """What `trainlift estimate` predicts this run allocates (its total less the runtime allowance, which
    torch.cuda.max_memory_allocated does not see: CUDA context, NCCL buffers, allocator slack)."""
    from trainlift.estimate.memory import Workload, memory_items
    from trainlift.estimate.shape import shape_of
    from trainlift.ops.model_config import read_model_config

    shape = shape_of(read_model_config(spec.model))
    lora = spec.model.lora
    gpu = device.type == "cuda"
    workload = Workload(spec.train.micro_batch_size, spec.data.seq_len, spec.train.grad_accum,
                        spec.model.activation_checkpointing, gpu=gpu, bf16=spec.model.dtype == "bf16",
                        workers=1, lora_params=shape.lora_params(lora.r, lora.target_modules) if lora else 0)
    return memory_items(shape, workload, runtime_bytes=0)["total"] / 2**30


def largest_fitting(ctx: Pass, candidates, ac: bool, compiled: bool, lora: dict | None) -> dict:
    """`measure` at each micro-batch, largest first, until one does not run out of memory."""
    tried = {}
    for micro_batch in candidates:
        try:
            result = measure(ctx, micro_batch, ac, compiled, lora)
        except Exception as exc:  # noqa: BLE001 - out of memory: try the next size; anything else ends the row
            if not is_out_of_memory(exc):
                raise
            tried[micro_batch] = error_text(exc)
        else:
            return {"micro_batch": micro_batch, **result, "out_of_memory": tried, "error": None}
        finally:
            free_memory(ctx.device)
    return {"micro_batch": None, "out_of_memory": tried, "error": "out of memory at every micro-batch size"}


def combination(ctx: Pass, candidates, ac: bool, compiled: bool, lora: dict | None) -> dict:
    row = {"activation_checkpointing": ac, "compile": compiled, "lora": lora is not None,
           "compile_backend": ctx.sizes.compile_backend if compiled else None, "seq": ctx.sizes.seq}
    if ctx.left() < ctx.sizes.min_combination_s:
        return {**row, "skipped": f"{ctx.left():.0f} s of the time budget left", "error": None}
    try:
        return {**row, **largest_fitting(ctx, candidates, ac, compiled, lora)}
    except Exception as exc:  # noqa: BLE001 - one failing combination must not hide the others
        traceback.print_exc()
        return {**row, "error": error_text(exc), "traceback": traceback.format_exc(limit=-12)}
    finally:
        free_memory(ctx.device)


def stage_qwen15b(ctx: Pass) -> dict:
    rows, fitted = [], {}
    for ac in (False, True):
        for compiled in (False, True):
            # compile needs no more memory than eager: start from the size that fitted without it
            start = fitted.get(ac) or max(ctx.sizes.micro_batches)
            row = combination(ctx, [m for m in ctx.sizes.micro_batches if m <= start], ac, compiled, None)
            rows.append(row)
            if not compiled and row.get("micro_batch"):
                fitted[ac] = row["micro_batch"]
    return summarize(ctx, rows)


def stage_qwen15b_lora(ctx: Pass) -> dict:
    return summarize(ctx, [combination(ctx, ctx.sizes.micro_batches, True, False, LORA)])


def summarize(ctx: Pass, rows: list[dict]) -> dict:
    from trainlift.train.run import metrics

    done = [r for r in rows if r.get("tokens_per_s")]
    best = max(done, key=lambda r: r["tokens_per_s"]) if done else {}
    failed = [f"{label(r)}: {r['error']}" for r in rows if r.get("error")]
    if failed and not done:
        raise RuntimeError("; ".join(failed))
    return {"model": "Qwen2.5-1.5B architecture" if not ctx.smoke else "tiny Qwen2", "seq": ctx.sizes.seq,
            "peak_flops": metrics.device_peak_flops(ctx.device), "results": rows,
            "tokens_per_s": best.get("tokens_per_s"), "mfu": best.get("mfu"),
            "peak_memory_gib": best.get("peak_memory_gib"), "best": label(best) if best else None,
            "failed_combinations": failed}


def label(row: dict) -> str:
    return (f"{'LoRA' if row.get('lora') else 'full'}, AC {'on' if row.get('activation_checkpointing') else 'off'}, "
            f"compile {'on' if row.get('compile') else 'off'}")


# --- 5. checkpoint


def directory_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def state_bytes(model, optimizer) -> int:
    """This rank's model and optimizer state: about what one checkpoint writes."""
    import torch

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    tensors = [local(p) for p in model.parameters()]
    tensors += [local(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def timed_save(w, model, optimizer, scheduler, step: int, upload: bool) -> dict:
    """The parts of recipe.save that block the loop, timed: the shard written to a local directory, its copy into
    run storage (what ray.train.report does, with pyarrow's copy_files, before it returns), then COMPLETE and
    pruning. Barriers are free in a world of one."""
    from trainlift.train.run import checkpoint

    target = f"{w.run_path}/{checkpoint.dir_name(step)}"
    with tempfile.TemporaryDirectory(prefix="gpu-pass-ckpt-") as local_dir:
        synchronize(w.device)
        t0 = time.perf_counter()
        checkpoint.write_shard(local_dir, model, optimizer, scheduler, step, 0, w.rank, w.world)
        t1 = time.perf_counter()
        size = directory_bytes(local_dir)
        if upload:
            import pyarrow.fs as pafs

            w.fs.create_dir(target)
            pafs.copy_files(local_dir, target, destination_filesystem=w.fs)
        t2 = time.perf_counter()
    t3 = time.perf_counter()  # the local shard is gone
    if upload:
        checkpoint.mark_complete(w.fs, target, step, w.world)
        checkpoint.prune(w.fs, w.run_path, keep=1)
    t4 = time.perf_counter()
    shutil.rmtree(target, ignore_errors=True)
    return {"step": step, "bytes": size, "write_shard_s": t1 - t0, "upload_s": t2 - t1 if upload else None,
            "remove_local_s": t3 - t2, "complete_and_prune_s": t4 - t3 if upload else None, "blocked_s": t4 - t0,
            "write_gb_per_s": size / (t1 - t0) / 1e9}


def timed_async_save(w, model, optimizer, group) -> dict:
    """What the recipe's asynchronous save holds the loop for (`saving.start_write`: the copy to pinned host
    memory and the hand-off to DCP's checkpointing process), and how long the write then takes in the background."""
    from trainlift.train.run import saving

    with tempfile.TemporaryDirectory(prefix="gpu-pass-async-") as local_dir:
        synchronize(w.device)
        t0 = time.perf_counter()
        written, stager = saving.start_write(local_dir, model, optimizer, group, w.device)
        t1 = time.perf_counter()
        written.result()
        t2 = time.perf_counter()
        if stager is not None:
            stager.close()
        size = directory_bytes(local_dir)
    return {"bytes": size, "blocked_s": t1 - t0, "write_s": t2 - t1, "pinned": stager is not None}


def stage_checkpoint(ctx: Pass) -> dict:
    import torch.distributed as dist

    from trainlift.train import recipe

    w = make_worker(ctx, synthetic_spec(ctx, 1, True, None, 1), "checkpoint")
    model, _, fpt = recipe.build_model(w)
    optimizer, scheduler = recipe.build_optimizer(model, w)
    recipe_run(w, model, optimizer, scheduler, synthetic_packed(ctx), fpt)  # one step: the optimizer has state
    expected = state_bytes(model, optimizer)
    upload = shutil.disk_usage(w.run_path).free > 2.5 * expected
    saves = []
    for i in range(ctx.sizes.checkpoint_repeats):
        if saves and ctx.left() < 3 * saves[-1]["blocked_s"]:
            break
        saves.append(timed_save(w, model, optimizer, scheduler, i + 1, upload))
    group = dist.new_group(backend="gloo")  # async_save needs a CPU process group, as the recipe's saver has
    asyncs = [timed_async_save(w, model, optimizer, group) for _ in range(ctx.sizes.checkpoint_repeats)]
    sync_blocked = statistics.median(s["blocked_s"] for s in saves)
    # The first async save also starts the checkpointing process: the later ones are what a run sees.
    async_blocked = statistics.median(a["blocked_s"] for a in asyncs[1:] or asyncs)
    return {"state_bytes": expected, "saves": saves, "blocked_s": sync_blocked,
            "upload": upload if upload else "skipped: not enough free disk for the shard and its copy",
            "async": asyncs, "async_blocked_s": async_blocked, "async_over_sync": async_blocked / sync_blocked}


# --- 6. NCCL


def nccl_log_path(ctx: Pass) -> Path:
    return ctx.out / NCCL_LOG


def log_nccl_to_file(ctx: Pass) -> None:
    """NCCL reads these once, when it first initialises: set before the process group's first collective."""
    from trainlift.doctor.nccl_log import NCCL_DEBUG_ENV

    ctx.out.mkdir(parents=True, exist_ok=True)
    nccl_log_path(ctx).unlink(missing_ok=True)
    os.environ.update(NCCL_DEBUG_ENV)
    os.environ["NCCL_DEBUG_FILE"] = str(nccl_log_path(ctx))


def timed_all_reduce(tensor, device, repeats: int) -> list[float]:
    import torch.distributed as dist

    times = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        dist.all_reduce(tensor)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def nccl_ranks(ctx: Pass) -> int:
    """One rank per GPU (NCCL refuses two ranks on one device); the CPU smoke takes the same path with two."""
    import torch

    return torch.cuda.device_count() if ctx.device.type == "cuda" else 2


def all_reduce_rank(rank: int, world: int, port: int, n: int, backend: str, out: str) -> None:
    """One rank of the all-reduce stage, in its own process: init, a warm-up, a checked sum, five timed repeats;
    rank 0 writes what it measured to `out`."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
        os.environ["NCCL_DEBUG_FILE"] = f"{out}.rank{rank}.log"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        pattern = torch.arange(n, dtype=torch.float32, device=device) % 1024  # sums stay exact in fp32
        tensor = pattern.clone()
        timed_all_reduce(tensor, device, 1)  # warm-up
        tensor.copy_(pattern)
        times = timed_all_reduce(tensor, device, 1)
        correct = bool(torch.equal(tensor, pattern * world))
        times += timed_all_reduce(tensor, device, 4)
        if rank == 0:
            Path(out).write_text(json.dumps({"times": times, "sum_correct": correct}))
    finally:
        dist.destroy_process_group()


def stage_nccl(ctx: Pass) -> dict:
    import socket

    import torch.multiprocessing as mp

    from trainlift.doctor.nccl_log import classify_log_text

    world, n = nccl_ranks(ctx), ctx.sizes.allreduce_bytes // 4
    backend = "nccl" if ctx.device.type == "cuda" else "gloo"
    if world < 2:
        return {"backend": backend, "world": world, "measured": False,
                "not_measured": "one GPU lent: NCCL needs a rank on each of two or more GPUs, and a world of one "
                                "moves no bytes, so the transport and its bandwidth were not measured"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = ctx.run_dir("all-reduce") / "rank0.json"
    mp.spawn(all_reduce_rank, args=(world, port, n, backend, str(out)), nprocs=world, join=True)
    measured = json.loads(out.read_text())
    log = Path(f"{out}.rank0.log")
    text = log.read_text(errors="replace") if log.exists() else ""
    if log.exists():
        shutil.copy(log, nccl_log_path(ctx))
    median_s = statistics.median(measured["times"])
    return {"backend": backend, "world": world, "measured": True, "bytes": n * 4,
            "sum_correct": measured["sum_correct"], "median_s": median_s, "algbw_gb_per_s": n * 4 / median_s / 1e9,
            "busbw_gb_per_s": n * 4 / median_s / 1e9 * 2 * (world - 1) / world,
            "nccl_log": NCCL_LOG if log.exists() else None, "log_head": text.splitlines()[:LOG_HEAD_LINES],
            "verdict": classify_log_text(text, source=NCCL_LOG).to_dict() if backend == "nccl" else None}


PACKED_ROWS = ((700, 300, 1048), (1024, 1024))  # two rows of 2,048 tokens, packed differently
PACKED_TOLERANCE = {"bf16": 0.05, "fp32": 1e-4}  # max |logit difference| packed against alone


def stage_packed(ctx: Pass) -> dict:
    """Each kernel keeps the examples of a two-row micro-batch apart, as `loss.model_inputs` hands them over."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from trainlift.train.model.kernels import flash_attn_status
    from trainlift.train.model.loss import model_inputs

    rows = PACKED_ROWS if not ctx.smoke else ((10, 5, 9), (4, 20))
    config = Qwen2Config(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=4096)  # head_dim 128, as Qwen2.5's
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    kernels = (["flash_attention_2"] if ctx.device.type == "cuda" and flash_attn_status()[0] else []) + [
        "flex_attention", "sdpa"]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (len(rows), sum(rows[0])), generator=generator).to(ctx.device)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows]).to(ctx.device)
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": positions}
    results = {}
    for kernel in kernels:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=kernel,
                                                 dtype=dtype).to(ctx.device)
        try:
            with torch.no_grad():
                packed = logits_for(model, batch, model_inputs)
                worst = 0.0
                for r, row in enumerate(rows):
                    start = 0
                    for n in row:
                        part = slice(start, start + n)
                        alone = logits_for(model, {k: v[r:r + 1, part] for k, v in batch.items()}, model_inputs)
                        worst = max(worst, (packed[r, part] - alone[0]).abs().max().item())
                        start += n
            results[kernel] = {"max_abs_diff": worst, "kept_apart": worst <= PACKED_TOLERANCE[ctx.dtype],
                               "error": None, "backward": backward_runs(model, batch, model_inputs, ctx)}
        except Exception as exc:  # noqa: BLE001 - a kernel that fails here is the finding
            results[kernel] = {"error": error_text(exc), "kept_apart": None, "backward": None}
        del model
        free_memory(ctx.device)
    return {"rows": [list(r) for r in rows], "head_dim": 128, "kernels": results}


def backward_runs(model, batch: dict, model_inputs, ctx: Pass) -> bool | str | None:
    """True, or the error of the kernel's backward; None where it is not tried (flex has none on a CPU)."""
    if ctx.device.type != "cuda" and model.config._attn_implementation == "flex_attention":
        return None
    try:
        inputs, _ = model_inputs(model, batch)
        model(**inputs).logits.float().mean().backward()
        return True
    except Exception as exc:  # noqa: BLE001 - flex's shared-memory limit on sm_86/89 is the finding
        return error_text(exc)


def logits_for(model, batch: dict, model_inputs) -> "torch.Tensor":
    """Logits per row of `batch`, given the model the recipe's inputs (which may flatten the rows into one)."""
    inputs, _ = model_inputs(model, batch)
    out = model(**inputs).logits.float()
    size = batch["input_ids"].size(1)
    return out.reshape(batch["input_ids"].size(0), -1, out.size(-1))[:, :size] if out.size(0) == 1 and \
        batch["input_ids"].size(0) > 1 else out[:, :size]


# --- the run


def run_stage(ctx: Pass, name: str, fn) -> None:
    if name in HEAVY_STAGES and ctx.left() < 0:
        fn = skipped
    print(f"== {name} ({ctx.left():.0f} s of the budget left)", flush=True)
    t0 = time.perf_counter()
    try:
        result = {**fn(ctx), "error": None}
    except Exception as exc:  # noqa: BLE001 - a failing stage must not hide the others
        traceback.print_exc()
        result = {"error": error_text(exc), "traceback": traceback.format_exc(limit=-12)}
    result["wall_s"] = time.perf_counter() - t0
    ctx.stages[name] = result
    free_memory(ctx.device)
    write_outputs(ctx)
    print(f"== {name}: {'ok' if result['error'] is None else result['error']} in {result['wall_s']:.1f} s", flush=True)


def command() -> str:
    """The command as given, the output directory written as $OUT when it is that."""
    out = os.environ.get("OUT")
    return shlex.join(["python", "bench/gpu_pass.py"]) + "".join(
        " $OUT" if out and arg == out else f" {shlex.quote(arg)}" for arg in sys.argv[1:])


def versions() -> dict:
    from importlib import metadata

    import torch

    found = {"python": platform.python_version(), "torch_cuda": torch.version.cuda}
    for name in ("torch", "transformers", "peft", "pyarrow", "pydantic", "numpy"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def report(ctx: Pass) -> dict:
    import torch

    device_name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    return {"command": command(), "date": ctx.started.strftime("%Y-%m-%d %H:%M UTC"), "smoke": ctx.smoke,
            "device": device_name, "versions": versions(), "ray_importable": ray_importable(),
            "budget_s": ctx.args.budget_s, "stages": ctx.stages}


def ray_importable() -> bool:
    try:
        return importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):
        return False


def write_outputs(ctx: Pass) -> None:
    data = report(ctx)
    ctx.out.mkdir(parents=True, exist_ok=True)
    (ctx.out / "gpu_pass.json").write_text(json.dumps(data, indent=2, default=str))
    (ctx.out / "gpu_pass.md").write_text(section(data, key="gpu_pass"))


# --- the Markdown section


def fmt(value, spec: str = ".3g", none: str = "—") -> str:
    return none if value is None else format(value, spec)


def stage_table(stages: dict) -> str:
    rows = [[name, "skipped" if s.get("skipped") else "ok" if s["error"] is None else "failed",
             fmt(s.get("wall_s"), ".1f"), s["error"] or ""] for name, s in stages.items()]
    return bl.table(["stage", "result", "wall s", "error"], rows)


def recipe_line(s: dict) -> str:
    if s.get("error") or "first_loss" not in s:
        return "Tiny recipe: see the stage table."
    return (f"Tiny recipe ({s['steps']} steps, {s['dtype']}): train loss {s['first_loss']:.3f} → {s['last_loss']:.3f}, "
            f"eval loss {s['initial_eval_loss']:.3f} → {s['eval_loss']:.3f}; export loaded by from_pretrained (fp32): "
            f"max |logits difference| {s['export_logits_max_abs_diff']:.2g}, {s['export_relative_diff']:.2g} of the "
            f"largest logit (tolerance {s['export_tolerance']:g}), next token agreeing at "
            f"{s['export_argmax_agreement']:.1%} of positions: {'matches' if s['export_matches'] else 'DIFFERS'}.")


def throughput_table(stages: dict) -> str:
    rows = []
    for name in ("qwen15b", "qwen15b_lora"):
        for r in stages.get(name, {}).get("results", []):
            oom = ", ".join(str(m) for m in r.get("out_of_memory", {}))
            rows.append([label(r), fmt(r.get("micro_batch"), "d"), fmt(r.get("step_s") and r["step_s"] * 1000, ".1f"),
                         fmt(r.get("tokens_per_s"), ",.0f"), fmt(r.get("mfu"), ".1%"), fmt(r.get("peak_memory_gib"), ".2f"),
                         fmt(r.get("predicted_gib"), ".2f"), oom, r.get("skipped") or r.get("error") or ""])
    return bl.table(["model", "micro-batch", "ms/step", "tokens/s", "MFU", "peak memory GiB",
                     "estimate GiB (allocated)", "out of memory at", "note"], rows)


def checkpoint_line(s: dict) -> str:
    if s.get("error") or not s.get("saves"):
        return "Checkpoint: see the stage table."
    last = s["saves"][-1]
    return (f"Checkpoint ({last['bytes'] / 2**30:.1f} GiB per save): the loop is blocked {s['blocked_s']:.1f} s per "
            f"checkpoint (write_shard {last['write_shard_s']:.1f} s at {last['write_gb_per_s']:.2f} GB/s, copy to run "
            f"storage {fmt(last['upload_s'], '.1f')} s) when synchronous; asynchronous (checkpoint.mode: async, "
            f"{'pinned' if s['async'][-1]['pinned'] else 'pageable'} host memory) it holds the loop "
            f"{s['async_blocked_s']:.2f} s ({s['async_over_sync']:.2f}x), the write then taking "
            f"{s['async'][-1]['write_s']:.1f} s in the background.")


def nccl_line(s: dict) -> str:
    if s.get("error") or "measured" not in s:
        return "All-reduce: see the stage table."
    if not s["measured"]:
        return f"All-reduce: not measured ({s['not_measured']})."
    verdict = f"NCCL log verdict: {s['verdict']['transport']}" if s["verdict"] else "no NCCL log (gloo)"
    return (f"All-reduce ({s['backend']}, {s['world']} ranks, {s['bytes'] / 2**20:g} MiB): {s['median_s'] * 1000:.2f} ms, "
            f"{s['algbw_gb_per_s']:.1f} GB/s algorithm bandwidth, {s['busbw_gb_per_s']:.1f} GB/s bus bandwidth, sum "
            f"{'correct' if s['sum_correct'] else 'WRONG'}; {verdict}.")


def packed_line(s: dict) -> str:
    if not s.get("kernels"):
        return "Packed rows: not run."
    def said(r: dict) -> str:
        backward = {True: "backward ran", None: "backward not tried"}.get(r["backward"], f"backward: {r['backward']}")
        return f"max |diff| {r['max_abs_diff']:.2g}, {'apart' if r['kept_apart'] else 'MIXED'}, {backward}"

    parts = [f"{k}: " + (f"failed ({r['error']})" if r["error"] else said(r)) for k, r in s["kernels"].items()]
    head = f"Packed rows ({len(s['rows'])} rows, head_dim {s['head_dim']}), packed against alone: "
    return head + "; ".join(parts) + "."


def section(data: dict, key: str) -> str:
    v, stages = data["versions"], data["stages"]
    size = "toy sizes on the CPU (--smoke)" if data["smoke"] else "one GPU"
    parts = [
        f"## GPU pass: the recipe without Ray on {size}", "",
        f"- Command: `{data['command']}` (run as `bash bench/gpu_pass.sh`)",
        f"- Machine: {data['device']}, torch {v['torch']} (CUDA {v['torch_cuda']}), Python {v['python']}, "
        f"transformers {v['transformers']}, peft {v['peft']}, Ray {'present' if data['ray_importable'] else 'absent'}",
        f"- Date: {data['date']}", "", stage_table(stages), "",
        recipe_line(stages.get("tiny_recipe", {})), "", throughput_table(stages), "",
        checkpoint_line(stages.get("checkpoint", {})), "", nccl_line(stages.get("nccl", {})), "",
        packed_line(stages.get("packed", {})),
    ]
    body = "\n".join(parts)
    return f"{bl.MARKER_OPEN.format(key=key)}\n{body}\n{bl.MARKER_CLOSE.format(key=key)}\n"


def skipped(ctx: Pass) -> dict:
    return {"skipped": "the time budget is spent"}


HEAVY_STAGES = ("qwen15b", "qwen15b_lora", "checkpoint")  # not started once the budget is spent
STAGE_FUNCTIONS = {"doctor": stage_doctor, "tiny_recipe": stage_tiny_recipe, "qwen15b": stage_qwen15b,
                   "qwen15b_lora": stage_qwen15b_lora, "checkpoint": stage_checkpoint, "nccl": stage_nccl,
                   "packed": stage_packed}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (gloo, fp32)")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "bench" / "out"),
                        help="where gpu_pass.json and gpu_pass.md go (default: $OUT, else bench/out)")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds after which no throughput combination or heavy stage starts (default 420; 300 "
                        "with --smoke): the whole pass then ends within the device's 560 s")
    args = parser.parse_args()
    args.budget_s = args.budget_s or (300.0 if args.smoke else 420.0)
    unknown = set(args.stages.split(",")) - set(STAGES)
    if unknown:
        parser.error(f"unknown stages: {', '.join(sorted(unknown))}")
    return args


def main() -> int:
    args = parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    import torch.distributed as dist

    if not args.smoke and not torch.cuda.is_available():
        sys.exit("no CUDA device here: bench/gpu_pass.sh --smoke runs the pass at toy size on the CPU")
    device = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    ctx = Pass(args, device)
    chosen = [name for name in STAGES if name in args.stages.split(",")]
    if "doctor" in chosen:  # before NCCL's variables are set, so the report shows the machine's own
        run_stage(ctx, "doctor", stage_doctor)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        log_nccl_to_file(ctx)
    init_single_process_group(device)
    try:
        for name in [name for name in chosen if name != "doctor"]:
            run_stage(ctx, name, STAGE_FUNCTIONS[name])
    finally:
        dist.destroy_process_group()
        shutil.rmtree(ctx.tmp, ignore_errors=True)
    write_outputs(ctx)
    print(f"wrote {ctx.out / 'gpu_pass.json'} and {ctx.out / 'gpu_pass.md'}", flush=True)
    return 1 if any(stage["error"] for stage in ctx.stages.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
