"""The training loop that runs in every Ray Train worker. Read it top to bottom.

One step = `grad_accum` micro-batches of `micro_batch_size` packed rows on each
worker. The loss is the sum of token losses over the whole global batch divided
by its trainable-token count, so gradients do not depend on how the batch is
split across workers. `ray.train.report()` is called only at evaluation and
checkpoint boundaries (it is a cross-worker barrier drained on a 2 s poll);
per-step metrics go to metrics.jsonl and, at most twice a second, to the driver's progress board.
"""

from __future__ import annotations

import math
import tempfile
import time

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from trainlift.config.job import JobSpec
from trainlift.train import checkpoint, data, datacache, export, lora, metrics, preflight, trackers, weights
from trainlift.train.loss import token_loss_sum
from trainlift.train.model import apply_fsdp, fill_weights, flops_per_token, load_tokenizer, sharded_config


BOARD_POST_INTERVAL_S = 0.5  # the driver reads the board this often; posting every step only costs CPU


def lr_lambda(warmup: int, total: int, min_ratio: float):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def trainable_tokens(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["labels"][:, 1:] != data.IGNORE).sum())


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def micro_batches_per_step(spec: JobSpec, world: int) -> int:
    """`train.grad_accum`, raised when an elastic run has fewer than its max workers, so that a step still
    covers the global batch of max workers (exactly when max * grad_accum divides by world)."""
    if not spec.scaling.elastic:
        return spec.train.grad_accum
    return max(1, -(-spec.train.grad_accum * spec.scaling.max_workers // world))


def step_batches(packed: data.Packed, spec: JobSpec, cursor: int, rank: int, world: int, device) -> list[dict]:
    """This worker's micro-batches for the step that starts at the global `cursor`."""
    per_micro = spec.train.micro_batch_size * world
    accum = micro_batches_per_step(spec, world)
    indices = data.global_indices(len(packed.rows), spec.train.seed, cursor, per_micro * accum)
    micro = [indices[i * per_micro:(i + 1) * per_micro] for i in range(accum)]
    return [to_device(data.collate([packed.rows[j] for j in data.rank_slice(m, rank, world)]), device) for m in micro]


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def sync_every_micro_batch(spec: JobSpec, device: torch.device) -> bool:
    """`train.accum_sync`; auto is the memory-safe choice on GPU and the one with fewer collectives on CPU."""
    if spec.train.accum_sync == "auto":
        return device.type != "cpu"
    return spec.train.accum_sync == "reduce_scatter_every_micro_batch"


def accumulate_gradients(model, batches: list[dict], world: int, device, stop_vote: float = 0.0,
                         sync_each: bool = True):
    """Backward over this worker's micro-batches; returns (global mean loss, global token count, stop votes).
    The stop vote rides on the token-count all-reduce, so asking every rank costs no collective of its own.
    Without `sync_each`, gradients stay unsharded (fp32) until the last micro-batch reduce-scatters them."""
    local = [float(sum(trainable_tokens(b) for b in batches)), float(sum(b["num_tokens"] for b in batches)), stop_vote]
    global_trainable, global_tokens, stop_votes = all_reduce_sum(local, device)
    loss_sum = 0.0
    for i, batch in enumerate(batches):
        model.set_requires_gradient_sync(sync_each or i == len(batches) - 1)
        loss = token_loss_sum(model, batch)
        # FSDP averages gradients over workers; scale so the result is the global-batch mean.
        (loss * world / max(global_trainable, 1.0)).backward()
        loss_sum += loss.item()
    (total_loss,) = all_reduce_sum([loss_sum], device)
    return total_loss / max(global_trainable, 1.0), global_tokens, stop_votes


def train_step(model, optimizer, scheduler, batches: list[dict], max_grad_norm: float, world: int, device,
               stop_vote: float = 0.0, sync_each: bool = True):
    """One optimizer step; returns (loss, grad_norm, global tokens, whether any rank voted to stop)."""
    loss, tokens, stop_votes = accumulate_gradients(model, batches, world, device, stop_vote, sync_each)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, float(grad_norm), tokens, stop_votes > 0


@torch.no_grad()
def evaluate(model, batches: list[dict | None], dummy: dict, device) -> float:
    model.eval()
    loss_sum, count = 0.0, 0
    for batch in batches:
        batch = to_device(batch or dummy, device)
        loss_sum += token_loss_sum(model, batch).item()
        count += trainable_tokens(batch)
    model.train()
    total, tokens = all_reduce_sum([loss_sum, float(count)], device)
    return total / max(tokens, 1.0)


def resume(fs, run_path: str, model, optimizer, scheduler, rank: int) -> tuple[int, int, str | None]:
    """Restore from the newest complete checkpoint in the run directory. Ray Train's `get_checkpoint()` is not
    used: the controller registers a report only when it next polls the workers, so it can lag behind what
    storage holds, and it knows nothing of the COMPLETE marker. Each rank reads only its part, from storage."""
    latest = checkpoint.latest_complete(fs, run_path)
    if rank == 0:
        checkpoint.remove_unfinished_after(fs, run_path, latest[0] if latest else -1)
    if latest is None:
        return 0, 0, None
    step, cursor = checkpoint.load(fs, latest[1], model, optimizer, scheduler, rank)
    return step, cursor, latest[1]


def save(model, optimizer, scheduler, step, cursor, rank, world, fs, run_path, keep, report_metrics) -> None:
    with tempfile.TemporaryDirectory(prefix="trainlift-ckpt-") as local_dir:
        checkpoint.write_shard(local_dir, model, optimizer, scheduler, step, cursor, rank, world)
        ray.train.report(report_metrics, checkpoint=ray.train.Checkpoint.from_directory(local_dir),
                         checkpoint_dir_name=checkpoint.dir_name(step))
    dist.barrier()  # every rank's upload has finished before the marker goes down
    if rank == 0:
        path = f"{run_path}/{checkpoint.dir_name(step)}"
        checkpoint.mark_complete(fs, path, step, world)
        checkpoint.prune(fs, run_path, keep)


class StopRequests:
    """Whether the driver asked the run to stop (SIGTERM/SIGINT): rank 0 polls the progress board without
    blocking and votes in the step's all-reduce (`train_step`), so every rank stops after the same step."""

    def __init__(self, board, rank: int):
        self.board = board if rank == 0 else None
        self.pending = self.board.stop_requested.remote() if self.board is not None else None

    def vote(self) -> float:
        if self.pending is not None:
            ready, _ = ray.wait([self.pending], timeout=0)
            if ready and ray.get(ready[0]):
                return 1.0
            if ready:
                self.pending = self.board.stop_requested.remote()
        return 0.0


def train_loop_per_worker(config: dict) -> None:
    spec = JobSpec.model_validate(config["spec"])
    board, stop_at = config.get("board"), config.get("stop_at_step")
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    bf16 = spec.model.dtype == "bf16" or (spec.model.dtype == "auto" and device.type == "cuda")
    storage = ctx.get_storage()
    fs, run_path = storage.storage_filesystem, storage.experiment_fs_path
    if not config.get("skip_doctor"):
        preflight.check_stack(spec.scaling.expect_fabric)

    tokenizer = load_tokenizer(spec.model)
    train_data, eval_data = datacache.load_splits(spec, tokenizer, rank, config.get("data_cache"))

    model = weights.empty_model(sharded_config(spec.model))
    model_config, fpt = model.config, flops_per_token(model, spec.data.seq_len)
    if spec.model.lora is not None:  # adapters go in before sharding; the base weights are frozen
        model = lora.apply(model, spec.model.lora)
        fpt = lora.flops_per_token(fpt, model)
        if bf16:
            lora.store_frozen_as(model, torch.bfloat16)
    param_counts = lora.parameter_counts(model)
    model = apply_fsdp(model, device, bf16, spec.model.activation_checkpointing)
    fill_weights(model, spec.model, spec.train.seed, device, lora.checkpoint_key if spec.model.lora else None)
    if spec.model.lora is not None:
        lora.init_adapters(model, spec.train.seed)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=spec.train.lr, weight_decay=spec.train.weight_decay,
                                  betas=(0.9, 0.95), fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(spec.train.warmup_steps, spec.train.steps, spec.train.min_lr_ratio))
    step, cursor, resumed_from = resume(fs, run_path, model, optimizer, scheduler, rank)
    dist.barrier()
    if config.get("nccl_log_prefix") and ctx.get_local_world_size() < world:  # NCCL over the network
        preflight.check_transport(config["nccl_log_prefix"], spec.scaling.expect_fabric)

    sink = trackers.open_sink(spec, fs, run_path, step) if rank == 0 else metrics.NullSink()
    peak = metrics.device_peak_flops(device)
    eval_batches = data.eval_batches(eval_data, rank, world, spec.train.micro_batch_size) if eval_data else []
    dummy = data.collate([{"input_ids": [0] * 8, "labels": [data.IGNORE] * 8, "position_ids": list(range(8))}])

    def run_eval(at_step: int) -> float | None:
        if not eval_batches:
            return None
        loss = evaluate(model, eval_batches, dummy, device)
        sink.write({"step": at_step, "eval_loss": loss, "time": time.time()})
        return loss

    start_row = {"event": "start", "step": step, "total_steps": spec.train.steps, "resumed_from": resumed_from,
                 "world": world, "time": time.time(), **param_counts}
    sink.write(start_row)  # marks the (re)start for `trainlift report`
    initial_eval = run_eval(step) if step == 0 else None
    if rank == 0 and board is not None:
        board.update.remote(start_row)
    rows_per_step = world * spec.train.micro_batch_size * micro_batches_per_step(spec, world)
    timed_tokens, timed_seconds, eval_loss, loss = 0.0, 0.0, initial_eval, float("nan")
    first_step = step
    stop_requests = StopRequests(board, rank)
    post_at = 0.0
    while step < spec.train.steps:
        t0 = time.perf_counter()
        batches = step_batches(train_data, spec, cursor, rank, world, device)
        loss, grad_norm, tokens, stop_requested = train_step(model, optimizer, scheduler, batches,
                                                             spec.train.max_grad_norm, world, device, stop_requests.vote(),
                                                             sync_every_micro_batch(spec, device))
        step_time = time.perf_counter() - t0
        step, cursor = step + 1, cursor + rows_per_step
        if step > first_step + 1:  # the first step after (re)start carries warm-up costs
            timed_tokens, timed_seconds = timed_tokens + tokens, timed_seconds + step_time
        row = {"step": step, "loss": loss, "lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm, "world": world,
               "tokens": tokens, "tokens_per_s": tokens / step_time, "step_time_s": step_time,
               "mfu": metrics.mfu(tokens / step_time / world, fpt, peak), "time": time.time()}
        sink.write(row)
        stopping = (stop_at is not None and step >= stop_at) or stop_requested
        if rank == 0 and board is not None and (stopping or step == spec.train.steps or time.monotonic() >= post_at):
            board.update.remote({"event": "step", **row, "total_steps": spec.train.steps})
            post_at = time.monotonic() + BOARD_POST_INTERVAL_S
        boundary_metrics = {"step": step, "loss": loss}
        if spec.train.eval_every and step % spec.train.eval_every == 0 and step < spec.train.steps:
            eval_loss = run_eval(step)
            boundary_metrics["eval_loss"] = eval_loss
            sink.flush()
            if not (spec.checkpoint.every_steps and step % spec.checkpoint.every_steps == 0):
                ray.train.report(boundary_metrics)
        periodic = spec.checkpoint.every_steps and (step % spec.checkpoint.every_steps == 0 or step == spec.train.steps)
        if periodic or (stopping and step < spec.train.steps):
            sink.flush()
            save(model, optimizer, scheduler, step, cursor, rank, world, fs, run_path, spec.checkpoint.keep, boundary_metrics)
        if stopping:
            break

    finished = step >= spec.train.steps
    if finished and eval_batches:
        eval_loss = run_eval(step)
    if finished:
        export_dtype = torch.bfloat16 if bf16 else torch.float32
        if spec.model.lora is not None:
            lora.save_adapter(fs, f"{run_path}/adapter", model, tokenizer)
        if spec.model.lora is None or spec.export.merge:
            merged = lora.merged_weights(model) if spec.model.lora else None  # W + alpha/r * B @ A, per tensor
            export.export_hf(fs, f"{run_path}/final", model, model_config, tokenizer, export_dtype,
                             source_dir=spec.model.path, weights=merged)
    tokens_per_s = timed_tokens / timed_seconds if timed_seconds else None
    summary = {
        "finished": finished, "steps": step, "final_loss": loss, "initial_eval_loss": initial_eval,
        "eval_loss": eval_loss, "tokens_per_s": tokens_per_s,
        "step_time_s": timed_seconds / max(1, step - first_step - 1) if timed_seconds else None,
        "mfu": metrics.mfu(tokens_per_s / world, fpt, peak) if tokens_per_s else None,
        "world_size": world, "resumed_from": resumed_from, "flops_per_token": fpt,
        "device": device.type, "truncated_examples": train_data.truncated, **param_counts,
    }
    sink.close(summary)
    if rank == 0 and board is not None:
        ray.get(board.finish.remote(summary))
