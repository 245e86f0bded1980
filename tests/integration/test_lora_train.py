"""LoRA on FSDP2 through the real recipe on a local Ray cluster (CPU, gloo), with the tiny Qwen2 model.

One 6-step, 2-worker LoRA run (checkpoints at 3 and 6) serves most tests."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainlift.train import checkpoint
from trainlift.train.launch import run_training

pytestmark = pytest.mark.usefixtures("ray_local")

LORA = ("model.lora.r=4", "model.lora.alpha=8", "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,up_proj]",
        "train.lr=1e-2")


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def lora_spec(tiny_spec, *overrides):
    return tiny_spec(*LORA, *overrides)


@pytest.fixture(scope="module")
def lora_run(tiny_assets, tmp_path_factory):
    from trainlift.config.job import apply_overrides, validate_job_spec

    storage = tmp_path_factory.mktemp("lora")
    raw = {
        "model": {"path": str(tiny_assets / "model")},
        "data": {"train": str(tiny_assets / "train.jsonl"), "eval": str(tiny_assets / "eval.jsonl"), "seq_len": 64},
        "train": {"steps": 6, "micro_batch_size": 2, "lr": 1e-3, "warmup_steps": 1, "seed": 0},
        "checkpoint": {"every_steps": 3, "keep": 2},
        "run": {"name": "lora", "storage": str(storage), "max_failures": 0},
    }
    spec = validate_job_spec(apply_overrides(raw, LORA))
    return run_training(spec), storage / "lora"


def test_lora_run_counts_parameters_and_checkpoints_only_adapters(lora_run, tiny_assets):
    """Counts in summary.json; a checkpoint holds the adapters and their optimizer state, no base weight."""
    import torch.distributed.checkpoint as dcp

    summary, run_dir = lora_run
    assert summary["finished"] and summary["steps"] == 6
    adapter = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    base_total = sum(t.numel() for t in load_file(tiny_assets / "model" / "model.safetensors").values())
    assert summary["trainable_params"] == sum(t.numel() for t in adapter.values()) > 0
    assert summary["total_params"] == base_total + summary["trainable_params"]
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert (on_disk["trainable_params"], on_disk["total_params"]) == (summary["trainable_params"], summary["total_params"])
    keys = dcp.FileSystemReader(str(run_dir / "checkpoint_00000003")).read_metadata().state_dict_metadata.keys()
    model_keys = [k for k in keys if k.startswith("model.")]
    assert len(model_keys) == len(adapter) and all(".lora_" in k for k in model_keys)
    assert all(".lora_" in k for k in keys if k.startswith("optim.state."))
    assert summary["eval_loss"] < summary["initial_eval_loss"]


def test_base_weights_are_bit_identical_and_only_adapters_changed(lora_run, tiny_assets):
    """final/ = the starting weights, bit for bit, except where an adapter merges in: W + alpha/r * B @ A."""
    _, run_dir = lora_run
    base = load_file(tiny_assets / "model" / "model.safetensors")
    final = load_file(run_dir / "final" / "model.safetensors")
    adapter = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    assert final.keys() == base.keys()
    adapted = 0
    for name, weight in base.items():
        layer = "base_model.model." + name.removesuffix(".weight")
        if f"{layer}.lora_A.weight" in adapter:
            lora_a, lora_b = adapter[f"{layer}.lora_A.weight"], adapter[f"{layer}.lora_B.weight"]
            assert lora_b.abs().sum() > 0, name  # peft starts B at zero: training moved it
            assert torch.equal(final[name], weight + (lora_b @ lora_a) * (8 / 4)), name
            adapted += 1
        else:
            assert torch.equal(final[name], weight), name
    assert adapted == 2 * 5  # 5 target modules in each of 2 layers


def test_adapter_loads_with_peft_and_matches_the_merged_export(lora_run, tiny_assets):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, run_dir = lora_run
    config = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_assets / "model"),
                                             run_dir / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "final").eval()
    batch = torch.randint(0, merged.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(with_adapter(input_ids=batch).logits, merged(batch).logits, rtol=1e-5, atol=1e-5)


def test_stop_then_resume_on_one_worker_reproduces_the_uninterrupted_losses(lora_run, tiny_spec):
    """Stopped after step 4 on 2 workers, resumed on 1 with grad_accum 2 (the same global batch): steps 1-4 equal
    the uninterrupted run's (rel 1e-6), steps 5-6 track it (rel 1e-4: another reduction order).
    export.merge=false: the adapter is written, the merged final/ is not."""
    _, ref_dir = lora_run
    spec = lora_spec(tiny_spec, "run.name=resume", "checkpoint.every_steps=2", "checkpoint.keep=1", "export.merge=false")
    first = run_training(spec, stop_at_step=4)
    assert not first["finished"] and first["steps"] == 4
    resumed = lora_spec(tiny_spec, "run.name=resume", "scaling.workers=1", "train.grad_accum=2", "export.merge=false")
    second = run_training(resumed)
    assert second["finished"] and second["world_size"] == 1 and second["resumed_from"].endswith("checkpoint_00000004")
    run_dir = Path(spec.run_uri)
    got, want = losses(run_dir), losses(ref_dir)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        assert got[step] == pytest.approx(want[step], rel=1e-6 if step <= 4 else 1e-4), step
    assert (run_dir / "adapter" / "adapter_model.safetensors").exists() and not (run_dir / "final").exists()


def test_two_worker_lora_gradients_equal_a_single_process_peft_reference(tiny_spec, tmp_path):
    """One step's adapter gradients under FSDP2 (2 workers, grad_accum 2) equal plain peft on the whole global
    batch (rtol 1e-5, atol 1e-7, fp32); frozen base weights get no gradient in either."""
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    from trainlift.train import data
    from trainlift.train.model import load_model, load_tokenizer
    from trainlift.train.recipe import step_batches, token_loss_sum, trainable_tokens

    spec = lora_spec(tiny_spec, "train.grad_accum=2")
    out = tmp_path / "lora_grads.pt"

    def with_adapters(job):
        from trainlift.train import lora

        model = lora.apply(load_model(job.model, job.train.seed), job.model.lora, job.train.seed)
        with torch.no_grad():  # B starts at zero, which would leave A without gradient
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
        return model

    def loop(config):
        import ray.train
        import ray.train.torch

        from trainlift.config.job import JobSpec
        from trainlift.train.model import apply_fsdp
        from trainlift.train.recipe import accumulate_gradients

        job = JobSpec.model_validate(config["spec"])
        ctx = ray.train.get_context()
        rank, world, device = ctx.get_world_rank(), ctx.get_world_size(), ray.train.torch.get_device()
        packed = data.prepare(job.data.train, job.data.format, load_tokenizer(job.model), job.data.seq_len)
        model = apply_fsdp(with_adapters(job), device, bf16=False, activation_checkpointing=False)
        loss, _, _ = accumulate_gradients(model, step_batches(packed, job, 0, rank, world, device), world, device)
        grads = {name: None if p.grad is None else p.grad.full_tensor() for name, p in model.named_parameters()}
        if rank == 0:
            torch.save({"loss": loss, "grads": grads}, config["out"])

    TorchTrainer(loop, train_loop_config={"spec": spec.model_dump(), "out": str(out)},
                 scaling_config=ScalingConfig(num_workers=2)).fit()
    fsdp = torch.load(out, weights_only=True)

    model = with_adapters(spec)
    packed = data.prepare(spec.data.train, spec.data.format, load_tokenizer(spec.model), spec.data.seq_len)
    both = [step_batches(packed, spec, 0, rank=r, world=2, device=torch.device("cpu")) for r in range(2)]
    flat = [b for rank_batches in both for b in rank_batches]
    loss = sum(token_loss_sum(model, b) for b in flat) / sum(trainable_tokens(b) for b in flat)
    loss.backward()

    assert fsdp["loss"] == pytest.approx(loss.item(), rel=1e-6)
    adapters = 0
    for name, param in model.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(fsdp["grads"][name], param.grad, rtol=1e-5, atol=1e-7, msg=name)
            adapters += 1
        else:
            assert param.grad is None and fsdp["grads"][name] is None, name
    assert adapters == 2 * 5 * 2  # A and B of 5 modules in 2 layers
