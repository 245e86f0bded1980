"""FSDP2 over 2 Ray Train workers computes the same gradients as one process on the same global batch, whether
gradient accumulation reduce-scatters after every micro-batch or only after the last (`train.accum_sync`), and
under HSDP when only the last micro-batch all-reduces across the replicas."""

import pytest
import torch

pytestmark = pytest.mark.usefixtures("ray_local")


def test_two_worker_fsdp_gradients_equal_single_process(tiny_spec, tmp_path):
    """Tolerance: rtol 1e-5, atol 1e-7 (fp32; only the reduction order differs)."""
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    from trainlift.train.data import examples as data
    from trainlift.train.model.build import load_model, load_tokenizer
    from trainlift.train.model.loss import token_loss_sum
    from trainlift.train.recipe import step_batches

    spec = tiny_spec("train.grad_accum=2")
    out = tmp_path / "fsdp_grads.pt"

    def loop(config):
        import ray.train
        import ray.train.torch

        from trainlift.config.job import JobSpec
        from trainlift.train.model.build import apply_fsdp
        from trainlift.train.recipe import accumulate_gradients

        job = JobSpec.model_validate(config["spec"])
        ctx = ray.train.get_context()
        rank, world, device = ctx.get_world_rank(), ctx.get_world_size(), ray.train.torch.get_device()
        packed = data.prepare(job.data.train, job.data.format, load_tokenizer(job.model), job.data.seq_len)
        results = {}
        # train.accum_sync: reduce_scatter_every_micro_batch, then last; then HSDP (2 replicas of 1 shard), every
        # micro-batch reduce-scattered and only the last all-reduced across the replicas
        for mode, mesh_shape, sync_each in (("fsdp-each", None, True), ("fsdp-last", None, False),
                                            ("hsdp-each", (2, 1), True)):
            model = apply_fsdp(load_model(job.model, job.train.seed), device, bf16=False,
                               activation_checkpointing=False, mesh_shape=mesh_shape)
            syncs: list[tuple[str, bool]] = []
            for name in ("set_requires_gradient_sync", "set_requires_all_reduce"):
                setter = getattr(model, name)
                setattr(model, name, lambda flag, name=name, setter=setter: (syncs.append((name, flag)), setter(flag)))
            # Only rank 1 asks to stop; the vote must reach rank 0 through the step's own all-reduce.
            loss, _, stop_votes = accumulate_gradients(model, step_batches(packed, job, 0, rank, world, device),
                                                       world, device, stop_vote=float(rank == 1), sync_each=sync_each)
            grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
            results[mode] = {"loss": loss, "stop_votes": stop_votes, "grads": grads, "syncs": syncs}
        if rank == 0:
            torch.save(results, config["out"])

    TorchTrainer(loop, train_loop_config={"spec": spec.model_dump(), "out": str(out)},
                 scaling_config=ScalingConfig(num_workers=2)).fit()
    by_mode = torch.load(out, weights_only=True)

    model = load_model(spec.model, spec.train.seed)
    packed = data.prepare(spec.data.train, spec.data.format, load_tokenizer(spec.model), spec.data.seq_len)
    # The global batch of step 1 is the union of both workers' micro-batches.
    both = [step_batches(packed, spec, 0, rank=r, world=2, device=torch.device("cpu")) for r in range(2)]
    flat = [b for rank_batches in both for b in rank_batches]
    total_tokens = sum(b["trainable_tokens"] for b in flat)
    loss = sum(token_loss_sum(model, b) for b in flat) / total_tokens
    loss.backward()

    # reduce_scatter_every_micro_batch never holds unsharded gradients across micro-batches; last defers the sync;
    # across HSDP's replicas only the last micro-batch all-reduces, and the gradients are still the global mean.
    sync, all_reduce = "set_requires_gradient_sync", "set_requires_all_reduce"
    assert by_mode["fsdp-each"]["syncs"] == [(sync, True), (all_reduce, False), (sync, True), (all_reduce, True)]
    assert by_mode["fsdp-last"]["syncs"] == [(sync, False), (sync, True)]
    assert by_mode["hsdp-each"]["syncs"] == by_mode["fsdp-each"]["syncs"]
    for fsdp in by_mode.values():
        assert fsdp["stop_votes"] == 1.0
        assert fsdp["loss"] == pytest.approx(loss.item(), rel=1e-6)
        for name, param in model.named_parameters():
            torch.testing.assert_close(fsdp["grads"][name], param.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_accum_sync_default_is_memory_safe_on_gpu(tiny_spec):
    from trainlift.train.recipe import sync_every_micro_batch

    assert sync_every_micro_batch(tiny_spec(), torch.device("cuda"))
    assert not sync_every_micro_batch(tiny_spec(), torch.device("cpu"))
    assert sync_every_micro_batch(tiny_spec("train.accum_sync=reduce_scatter_every_micro_batch"), torch.device("cpu"))
    assert not sync_every_micro_batch(tiny_spec("train.accum_sync=last"), torch.device("cuda"))
