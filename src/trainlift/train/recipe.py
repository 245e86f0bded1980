"""The training loop that runs in every Ray Train worker. Read it top to bottom.

One step = `grad_accum` micro-batches of `micro_batch_size` packed rows on each
worker. The loss is the sum of token losses over the whole global batch divided
by its trainable-token count (DPO: pair losses by the pair count, `loss_for`), so
gradients do not depend on how the batch is split across workers. `ray.train.report()` is called only at evaluation and
checkpoint boundaries (it is a cross-worker barrier drained on a 2 s poll);
per-step metrics go to metrics.jsonl and, at most twice a second, to the driver's progress board.
Ray is imported only inside the functions that talk to it: building, stepping and exporting need no Ray.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from trainlift.config.job import JobSpec
from trainlift.train.data import cache as datacache, examples as data
from trainlift.train.model import export, families, fetch, lora, objectives, weights
from trainlift.train.model.build import (BlockCheckpointing, StepFlops, apply_fsdp, attention_implementation,
                                         fill_weights, load_tokenizer, sharded_config, step_flops, with_recompute)
from trainlift.train.run import checkpoint, mesh as meshes, preflight
from trainlift.train.run.device import all_reduce_sum, to_device
from trainlift.train.run.reference import reference_logps, without_dropout
from trainlift.train.run.saving import Saver
from trainlift.train.run.runlog import RunLog
from trainlift.train.run.schedule import lr_lambda


def micro_batches_per_step(spec: JobSpec, world: int) -> int:
    """`train.grad_accum`, raised when an elastic run has fewer than its max workers, so that a step still
    covers the global batch of max workers (exactly when max * grad_accum divides by world)."""
    if not spec.scaling.elastic:
        return spec.train.grad_accum
    return max(1, -(-spec.train.grad_accum * spec.scaling.max_workers // world))


def step_batches(packed: data.Packed, spec: JobSpec, cursor: int, rank: int, world: int, device,
                 objective: objectives.Objective = objectives.SFT) -> list[dict]:
    """This worker's micro-batches for the step that starts at the global `cursor`."""
    per_micro = spec.train.micro_batch_size * world
    accum = micro_batches_per_step(spec, world)
    indices = data.global_indices(len(packed.rows), spec.train.seed, cursor, per_micro * accum)
    micro = [indices[i * per_micro:(i + 1) * per_micro] for i in range(accum)]
    return [to_device(objective.batch_of(packed, data.rank_slice(m, rank, world)), device) for m in micro]


def sync_every_micro_batch(spec: JobSpec, device: torch.device) -> bool:
    """`train.accum_sync`; auto is the memory-safe choice on GPU and the one with fewer collectives on CPU."""
    if spec.train.accum_sync == "auto":
        return device.type != "cpu"
    return spec.train.accum_sync == "reduce_scatter_every_micro_batch"


def accumulate_gradients(model, batches: list[dict], world: int, device, stop_vote: float = 0.0,
                         sync_each: bool = True, objective: objectives.Objective = objectives.SFT):
    """Backward over this worker's micro-batches; returns (global mean loss, global [tokens, attended pairs, then
    the objective's metrics as means], stop votes) as device tensors, none read back. The stop vote rides on the
    token-count all-reduce, so asking every rank costs no collective of its own. Without `sync_each`, gradients stay
    unsharded (fp32) until the last micro-batch reduce-scatters them; with it, each micro-batch reduce-scatters and,
    under HSDP, only the last all-reduces the summed shards across the replicas (FSDP2 keeps the partial sums in
    between)."""
    local = [float(sum(b[objective.normaliser] for b in batches)), float(sum(b["num_tokens"] for b in batches)),
             float(sum(b["attended_pairs"] for b in batches)), stop_vote]
    global_count, global_tokens, global_attended, stop_votes = all_reduce_sum(local, device)
    count = global_count.clamp(min=1.0)
    sums = torch.zeros(1 + len(objective.metrics), dtype=torch.float64, device=device)  # loss, then metrics
    for i, batch in enumerate(batches):
        last = i == len(batches) - 1
        model.set_requires_gradient_sync(sync_each or last)
        if sync_each:  # HSDP: reduce-scatter within the node every micro-batch, all-reduce across nodes once
            model.set_requires_all_reduce(last)
        loss, metric_sums = objective.loss(model, batch)
        # FSDP averages gradients over workers; scale so the result is the global-batch mean.
        (loss * (world / count).to(loss.dtype)).backward()
        sums += torch.cat([loss.detach().reshape(1), metric_sums.detach()]).double()
    means = all_reduce_sum(sums, device) / count
    return means[0], torch.cat([torch.stack([global_tokens, global_attended]), means[1:]]), stop_votes


class StepResult(NamedTuple):
    """A step's figures over all workers: mean loss, gradient norm, real tokens, Σ s² over packed examples,
    whether any worker voted to stop, and the objective's metrics by name (DPO's rewards)."""

    loss: float
    grad_norm: float
    tokens: float
    attended: float
    stop: bool
    metrics: dict[str, float] | None = None


def queue_step(model, optimizer, scheduler, batches: list[dict], max_grad_norm: float, world: int, device,
               stop_vote: float = 0.0, sync_each: bool = True,
               objective: objectives.Objective = objectives.SFT) -> torch.Tensor:
    """One optimizer step, queued on the device; returns its figures as one device tensor, not read back."""
    loss, counts, stop_votes = accumulate_gradients(model, batches, world, device, stop_vote, sync_each, objective)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return torch.cat([loss.reshape(1), grad_norm.double().reshape(1), counts, stop_votes.reshape(1)])


def read_step(figures: torch.Tensor, metrics: tuple[str, ...] = ()) -> StepResult:
    """The step's figures from the device: its one host sync, once the next step's batches are on their way."""
    loss, grad_norm, tokens, attended, *values, votes = figures.tolist()
    return StepResult(loss, grad_norm, tokens, attended, votes > 0, dict(zip(metrics, values)))


def train_step(*args, **kwargs) -> StepResult:
    """One optimizer step and its figures (`queue_step`, then `read_step`)."""
    return read_step(queue_step(*args, **kwargs), kwargs.get("objective", objectives.SFT).metrics)


@torch.no_grad()
def evaluate(model, batches: list[dict | None], dummy: dict, device,
             objective: objectives.Objective = objectives.SFT) -> tuple[float, dict[str, float]]:
    """The eval loss and the objective's metrics (as eval_<name>) over every worker's batches."""
    model.eval()
    sums, count = torch.zeros(1 + len(objective.metrics), dtype=torch.float64, device=device), 0
    for batch in batches:
        batch = to_device(batch or dummy, device)
        loss, metric_sums = objective.loss(model, batch)
        sums += torch.cat([loss.reshape(1), metric_sums]).double()
        count += batch[objective.normaliser]
    model.train()
    total, *values, counted = all_reduce_sum(torch.cat([sums, sums.new_tensor([float(count)])]), device).tolist()
    counted = max(counted, 1.0)
    return total / counted, {f"eval_{name}": value / counted for name, value in zip(objective.metrics, values)}


def resume(fs, run_path: str, latest: tuple[int, str] | None, model, optimizer, scheduler,
           rank: int) -> tuple[int, int, str | None]:
    """Restore from `latest`, the newest complete checkpoint in the run directory (`checkpoint.latest_complete`).
    Ray Train's `get_checkpoint()` is not used: the controller registers a report only when it next polls the
    workers, so it can lag behind what storage holds, and it knows nothing of the COMPLETE marker. Each rank reads
    only its part, from storage."""
    if rank == 0:
        checkpoint.remove_unfinished_after(fs, run_path, latest[0] if latest else -1)
    if latest is None:
        return 0, 0, None
    step, cursor = checkpoint.load(fs, latest[1], model, optimizer, scheduler, rank)
    return step, cursor, latest[1]


def extend_schedule(scheduler, train, step: int) -> None:
    """The resumed schedule taken to `train.steps` as `train.schedule_extension` says (unchanged when that is its
    plan), with the optimizer's LR set to the schedule's at `step`."""
    scheduler.lr_lambdas = [planned.extended(train.steps, train.schedule_extension, step, train.warmup_steps)
                            for planned in scheduler.lr_lambdas]
    for group, base, schedule in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * schedule(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


class StopRequests:
    """Whether the driver asked the run to stop (SIGTERM/SIGINT): rank 0 polls the progress board without
    blocking and votes in the step's all-reduce (`train_step`), so every rank stops after the same step."""

    def __init__(self, board, rank: int):
        self.board = board if rank == 0 else None
        self.pending = self.board.stop_requested.remote() if self.board is not None else None

    def vote(self) -> float:
        if self.pending is not None:
            import ray

            ready, _ = ray.wait([self.pending], timeout=0)
            if ready and ray.get(ready[0]):
                return 1.0
            if ready:
                self.pending = self.board.stop_requested.remote()
        return 0.0


@dataclass
class Worker:
    """This worker's place in the run, and the run's spec and storage."""

    spec: JobSpec
    rank: int
    world: int
    device: torch.device
    bf16: bool
    fs: Any
    run_path: str
    mesh: meshes.Mesh | None = None  # chosen by `build_model` when not given

    @classmethod
    def from_context(cls, spec: JobSpec) -> "Worker":
        import ray.train
        import ray.train.torch

        ctx = ray.train.get_context()
        device = ray.train.torch.get_device()
        storage = ctx.get_storage()
        return cls(spec, ctx.get_world_rank(), ctx.get_world_size(), device,
                   spec.model.dtype == "bf16" or (spec.model.dtype == "auto" and device.type == "cuda"),
                   storage.storage_filesystem, storage.experiment_fs_path)


def build_model(w: Worker, resume_from: str | None = None):
    """The model built on the meta device, sharded, then filled; returns (model, its config, its `StepFlops`).
    With model.lora, peft adds the adapters before sharding and freezes the base weights. A full fine-tune that
    resumes from a checkpoint takes its config from it and leaves every weight to `resume`: model.path is not
    read. LoRA still reads its frozen base from model.path."""
    lora_section = w.spec.model.lora
    from_checkpoint = resume_from is not None and lora_section is None
    config = (checkpoint.model_config(w.fs, resume_from) if from_checkpoint else None) or sharded_config(w.spec.model)
    families.check_loadable(config.to_dict())  # a hub model's config is first read here
    attention = attention_implementation(w.spec.model.attn_implementation, w.device, config, w.bf16)
    model = weights.empty_model(config, attention)
    model_config, fpt = model.config, step_flops(model)
    if lora_section is not None:
        model = lora.apply(model, lora_section)
        fpt = StepFlops(lora.flops_per_token(fpt.base, model), fpt.attention)
        if w.bf16:
            lora.store_frozen_as(model, torch.bfloat16)
    if w.spec.train.objective == "dpo" and not w.spec.train.dpo.dropout:
        without_dropout(model)
    fpt = with_recompute(fpt, model, BlockCheckpointing.of(w.spec.model))
    if w.mesh is None:
        w.mesh = meshes.agree(w.spec, w, model_config, lora.parameter_counts(model)["trainable_params"]
                              if lora_section is not None else 0)
    model = apply_fsdp(model, w.device, w.bf16, BlockCheckpointing.of(w.spec.model), w.mesh.shape,
                       compile_blocks=w.spec.train.compile)
    if from_checkpoint:  # `resume` fills every weight
        weights.zero_parameters(weights.materialize_shards(model, w.device))
        return model, model_config, fpt
    fill_weights(model, w.spec.model, w.spec.train.seed, w.device, lora.checkpoint_key if lora_section else None)
    if lora_section is not None:
        lora.init_adapters(model, w.spec.train.seed)
    return model, model_config, fpt


def build_optimizer(model, w: Worker):
    train = w.spec.train
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=train.lr, weight_decay=train.weight_decay,
                                  betas=(0.9, 0.95), fused=w.device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(train.warmup_steps, train.steps,
                                                                       train.min_lr_ratio))
    return optimizer, scheduler


class Evaluator:
    """Eval loss, and the objective's metrics (`metrics`, from the last evaluation), on this worker's slice of the
    eval split (every rank takes part; `None` without eval data)."""

    def __init__(self, model, eval_data, w: Worker, log: RunLog, objective: objectives.Objective = objectives.SFT):
        self.model, self.w, self.log, self.objective = model, w, log, objective
        rows = len(eval_data.rows) if eval_data else 0
        slices = data.worker_row_batches(rows, w.rank, w.world, w.spec.train.micro_batch_size) if rows else []
        self.batches = [objective.batch_of(eval_data, part, "eval") if part else None for part in slices]
        self.dummy = objective.collate([objectives.DUMMY_ROW], [], np.zeros(0) if objective.references else None)
        self.metrics: dict[str, float] = {}

    def __call__(self, at_step: int) -> float | None:
        if not self.batches:
            return None
        loss, self.metrics = evaluate(self.model, self.batches, self.dummy, self.w.device, self.objective)
        self.log.evaluated(at_step, loss, self.metrics)
        return loss


def train(w: Worker, model, optimizer, scheduler, train_data, step: int, cursor: int, evaluator: Evaluator,
          log: RunLog, stop_requests: StopRequests, stop_at: int | None) -> tuple[int, float, float | None]:
    """Steps until `train.steps`, or until a stop is asked for (checkpointed first); returns
    (step reached, last loss, last eval loss or None) once the last checkpoint is complete in storage."""
    spec = w.spec
    saver = Saver(w, spec.checkpoint.mode)  # a stop checkpoints even without periodic checkpoints
    rows_per_step = w.world * spec.train.micro_batch_size * micro_batches_per_step(spec, w.world)
    every_ckpt, every_eval = spec.checkpoint.every_steps, spec.train.eval_every
    loss, eval_loss = float("nan"), None
    objective = evaluator.objective
    batches = step_batches(train_data, spec, cursor, w.rank, w.world, w.device, objective)
    while step < spec.train.steps:
        t0 = time.perf_counter()
        figures = queue_step(model, optimizer, scheduler, batches, spec.train.max_grad_norm, w.world, w.device,
                             stop_requests.vote(), sync_every_micro_batch(spec, w.device), objective)
        step, cursor = step + 1, cursor + rows_per_step
        if step < spec.train.steps:  # the next step's rows, collated and copied while this step runs
            batches = step_batches(train_data, spec, cursor, w.rank, w.world, w.device, objective)
        result = read_step(figures, objective.metrics)
        loss = result.loss
        stopping = (stop_at is not None and step >= stop_at) or result.stop
        log.stepped(step, result, scheduler.get_last_lr()[0], time.perf_counter() - t0,
                    last=stopping or step == spec.train.steps)
        boundary_metrics = {"step": step, "loss": loss}
        if every_eval and step % every_eval == 0 and step < spec.train.steps:
            eval_loss = boundary_metrics["eval_loss"] = evaluator(step)
            boundary_metrics.update(evaluator.metrics)
            log.sink.flush()
            if not (every_ckpt and step % every_ckpt == 0):
                import ray.train  # only at a boundary: a run without evaluations or checkpoints needs no Ray

                ray.train.report(boundary_metrics)
        periodic = every_ckpt and (step % every_ckpt == 0 or step == spec.train.steps)
        if periodic or (stopping and step < spec.train.steps):
            log.sink.flush()
            log.checkpoint_held(step, saver.save(model, optimizer, scheduler, step, cursor, boundary_metrics))
        for done in saver.completed():
            log.sink.checkpointed(done)
        if stopping:
            break
    saver.wait()
    for done in saver.completed():
        log.sink.checkpointed(done)
    return step, loss, eval_loss


def export_run(w: Worker, model, model_config, tokenizer) -> None:
    """<run>/final/ (the merged model with LoRA, unless export.merge is off) and, with LoRA, <run>/adapter/."""
    spec = w.spec
    if spec.model.lora is not None:
        lora.save_adapter(w.fs, f"{w.run_path}/adapter", model, tokenizer, base_model=spec.model.path)
    if spec.model.lora is None or spec.export.merge:
        merged = lora.merged_weights(model) if spec.model.lora else None  # W + alpha/r * B @ A, per tensor
        source = fetch.cached_dir(spec.model.path, spec.model.revision) if spec.model.path else None  # for its generation config
        export.export_hf(w.fs, f"{w.run_path}/final", model, model_config, tokenizer,
                         torch.bfloat16 if w.bf16 else torch.float32, source_dir=str(source) if source else None,
                         weights=merged)


def train_loop_per_worker(config: dict) -> None:
    import ray.train

    spec = JobSpec.model_validate(config["spec"])
    w = Worker.from_context(spec)
    if not config.get("skip_doctor"):
        preflight.check_stack(spec.scaling.expect_fabric)
    tokenizer = functools.cache(lambda: load_tokenizer(spec.model))  # the driver built the data cache: load it late
    train_data, eval_data = datacache.load_splits(spec, tokenizer, w.rank, config.get("data_cache"))
    latest = checkpoint.latest_complete(w.fs, w.run_path)
    model, model_config, fpt = build_model(w, resume_from=latest[1] if latest else None)
    facts = {**lora.parameter_counts(model), "attention": model.config._attn_implementation, "mesh": w.mesh.as_dict(),
             "objective": spec.train.objective}
    optimizer, scheduler = build_optimizer(model, w)
    step, cursor, resumed_from = resume(w.fs, w.run_path, latest, model, optimizer, scheduler, w.rank)
    if resumed_from is not None:
        extend_schedule(scheduler, spec.train, step)
    dist.barrier()
    if config.get("nccl_log_prefix") and ray.train.get_context().get_local_world_size() < w.world:  # over the network
        preflight.check_transport(config["nccl_log_prefix"], spec.scaling.expect_fabric)

    log = RunLog(w, config.get("board"), step, fpt)
    start_row = log.started(step, resumed_from, facts)
    objective = objectives.loss_for(spec, model_config)
    if objective.pairs:
        objective = replace(objective, references=reference_logps(
            w, model, objective, {"train": train_data, "eval": eval_data}, config.get("data_cache"), step, log))
    evaluator = Evaluator(model, eval_data, w, log, objective)
    initial_eval = evaluator(step) if step == 0 else log.sink.recorded_initial_eval()
    log.post(start_row)
    step, loss, last_eval = train(w, model, optimizer, scheduler, train_data, step, cursor, evaluator, log,
                                  StopRequests(config.get("board"), w.rank), config.get("stop_at_step"))

    finished = step >= spec.train.steps
    eval_loss = last_eval  # a stopped run evaluated only at its start has no eval loss of its own yet
    if finished:
        eval_loss = evaluator(step) if evaluator.batches else eval_loss
        export_run(w, model, model_config, tokenizer())
    log.close({"finished": finished, "steps": step, "final_loss": loss, "initial_eval_loss": initial_eval,
               "eval_loss": eval_loss, **(evaluator.metrics if eval_loss is not None else {}),
               **log.throughput(step), "world_size": w.world, "resumed_from": resumed_from, "device": w.device.type,
               "truncated_examples": train_data.truncated, **facts})
