"""LoRA on FSDP2 through the real recipe on the shared local Ray cluster of the test run (CPU, gloo), with the
tiny Qwen2 model loaded the sharded way (meta device, peft, fully_shard, then the HF files read under peft's
renamed keys).

One 6-step, 2-worker LoRA run (checkpoints at 3 and 6) serves the first two tests; the third resumes a copy of its
step-3 checkpoint on 1 worker; the last is one 2-worker step compared with plain peft in this process."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainlift.train.launch import run_training

pytestmark = pytest.mark.usefixtures("ray_local")

LORA = ("model.lora.r=4", "model.lora.alpha=8", "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,up_proj]",
        "train.lr=1e-2")
ADAPTED_LAYERS = 2 * 5  # 5 target modules in each of 2 layers


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def lora_run(tiny_spec_at, tmp_path_factory):
    storage = tmp_path_factory.mktemp("lora")
    return run_training(tiny_spec_at(storage, *LORA, "run.name=lora")), storage / "lora"


def test_lora_run_checkpoints_only_adapters_and_leaves_base_weights_bit_identical(lora_run, tiny_assets):
    """Real: recipe, sharded load, DCP checkpoint, streamed merged export. Counts in summary.json; a checkpoint holds
    the adapters and their optimizer state, no base weight; final/ = the starting weights bit for bit, except where
    an adapter merges in: W + alpha/r * B @ A; no adapter key in final/."""
    import torch.distributed.checkpoint as dcp

    summary, run_dir = lora_run
    assert summary["finished"] and summary["steps"] == 6
    assert summary["eval_loss"] < summary["initial_eval_loss"]
    base = load_file(tiny_assets / "model" / "model.safetensors")
    adapter = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    assert summary["trainable_params"] == sum(t.numel() for t in adapter.values()) > 0
    assert summary["total_params"] == sum(t.numel() for t in base.values()) + summary["trainable_params"]
    on_disk = json.loads((run_dir / "summary.json").read_text())
    for key in ("trainable_params", "total_params"):
        assert on_disk[key] == summary[key], key

    keys = dcp.FileSystemReader(str(run_dir / "checkpoint_00000003")).read_metadata().state_dict_metadata.keys()
    model_keys = [k for k in keys if k.startswith("model.")]
    assert len(model_keys) == len(adapter) and all(".lora_" in k for k in model_keys)
    assert all(".lora_" in k for k in keys if k.startswith("optim.state."))

    final = load_file(run_dir / "final" / "model.safetensors")
    assert final.keys() == base.keys()
    adapted = 0
    for name, weight in base.items():
        layer = "base_model.model." + name.removesuffix(".weight")
        if f"{layer}.lora_A.weight" in adapter:
            lora_a, lora_b = adapter[f"{layer}.lora_A.weight"], adapter[f"{layer}.lora_B.weight"]
            assert lora_b.abs().sum() > 0, name  # B starts at zero: training moved it
            assert torch.equal(final[name], weight + (lora_b @ lora_a) * (8 / 4)), name
            adapted += 1
        else:
            assert torch.equal(final[name], weight), name
    assert adapted == ADAPTED_LAYERS


def test_adapter_loads_with_peft_and_matches_the_merged_export(lora_run, tiny_assets):
    """Real: peft's PeftModel.from_pretrained on the run's adapter/ and transformers on final/; logits within
    1e-5 (fp32)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, run_dir = lora_run
    config = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert config["base_model_name_or_path"] == str(tiny_assets / "model")  # the model.path the job gave
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_assets / "model"),
                                             run_dir / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "final").eval()
    plain = AutoModelForCausalLM.from_pretrained(tiny_assets / "model").eval()
    batch = torch.randint(0, merged.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted_logits = with_adapter(input_ids=batch).logits
        torch.testing.assert_close(adapted_logits, merged(batch).logits, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(adapted_logits, plain(batch).logits, atol=1e-3)


def test_resume_on_one_worker_from_a_two_worker_adapter_checkpoint_continues_the_losses(lora_run, tiny_spec_at,
                                                                                          tmp_path):
    """Real: DCP resharding 2 -> 1 of an adapter-only checkpoint read from storage, base weights read again from
    model.path. The step-3 checkpoint of the 2-worker run, resumed on 1 worker with grad_accum 2 (the same global
    batch): steps 4-6 track the uninterrupted run (rel 1e-4: another reduction order). export.merge=false: the
    adapter is written, the merged final/ is not."""
    _, ref_dir = lora_run
    run_dir = tmp_path / "resume"
    shutil.copytree(ref_dir / "checkpoint_00000003", run_dir / "checkpoint_00000003")
    spec = tiny_spec_at(tmp_path, *LORA, "run.name=resume", "scaling.workers=1", "train.grad_accum=2",
                        "export.merge=false")
    summary = run_training(spec)
    assert summary["finished"] and summary["world_size"] == 1
    assert summary["resumed_from"].endswith("checkpoint_00000003")
    got, want = losses(run_dir), losses(ref_dir)
    assert sorted(got) == [4, 5, 6]
    for step in (4, 5, 6):
        assert got[step] == pytest.approx(want[step], rel=1e-4), step
    assert (run_dir / "adapter" / "adapter_model.safetensors").exists() and not (run_dir / "final").exists()


def test_two_worker_lora_gradients_equal_a_single_process_peft_reference(tiny_spec_at, tmp_path):
    """Real: the recipe's `build_model` (meta, peft, FSDP2 on 2 Ray Train workers, sharded load, adapter init) and
    its gradient accumulation, against peft on transformers' from_pretrained in this process on the whole global
    batch. The initial adapters are equal bit for bit (the init does not depend on the world size); the loss
    within rel 1e-6; adapter gradients rtol 1e-5, atol 1e-7 (fp32); frozen base weights get no gradient."""
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer
    from transformers import AutoModelForCausalLM

    from trainlift.train.data import examples as data
    from trainlift.train.model import lora
    from trainlift.train.model.build import load_tokenizer
    from trainlift.train.model.loss import token_loss_sum
    from trainlift.train.recipe import step_batches

    spec = tiny_spec_at(tmp_path, *LORA, "run.name=grads", "train.grad_accum=2")
    out = tmp_path / "lora_grads.pt"

    def set_lora_b(model):  # B starts at zero, which would leave A without gradient
        from trainlift.train.model.weights import copy_shard

        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    copy_shard(p, torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)

    def loop(config):
        import ray.train
        import ray.train.torch

        from trainlift.config.job import JobSpec
        from trainlift.train.model import export
        from trainlift.train.recipe import Worker, accumulate_gradients, build_model

        job = JobSpec.model_validate(config["spec"])
        ctx = ray.train.get_context()
        rank, world, device = ctx.get_world_rank(), ctx.get_world_size(), ray.train.torch.get_device()
        packed = data.prepare(job.data.train, job.data.format, load_tokenizer(job.model), job.data.seq_len)
        model, _, _ = build_model(Worker(job, rank, world, device, bf16=False, fs=None, run_path=""))
        initial = {name: export.full_tensor(p) for name, p in model.named_parameters() if "lora_" in name}
        set_lora_b(model)
        loss, _, _ = accumulate_gradients(model, step_batches(packed, job, 0, rank, world, device), world, device)
        grads = {name: None if p.grad is None else p.grad.full_tensor() for name, p in model.named_parameters()}
        if rank == 0:
            torch.save({"loss": loss, "grads": grads, "initial": initial}, config["out"])

    TorchTrainer(loop, train_loop_config={"spec": spec.model_dump(), "out": str(out)},
                 scaling_config=ScalingConfig(num_workers=2)).fit()
    fsdp = torch.load(out, weights_only=True)

    model = lora.apply(AutoModelForCausalLM.from_pretrained(spec.model.path, dtype=torch.float32), spec.model.lora)
    lora.init_adapters(model, spec.train.seed)
    initial = {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}
    assert initial.keys() == fsdp["initial"].keys() and len(initial) == 2 * ADAPTED_LAYERS
    for name, tensor in initial.items():
        assert torch.equal(fsdp["initial"][name], tensor), name
    set_lora_b(model)
    packed = data.prepare(spec.data.train, spec.data.format, load_tokenizer(spec.model), spec.data.seq_len)
    both = [step_batches(packed, spec, 0, rank=r, world=2, device=torch.device("cpu")) for r in range(2)]
    flat = [b for rank_batches in both for b in rank_batches]
    loss = sum(token_loss_sum(model, b) for b in flat) / sum(b["trainable_tokens"] for b in flat)
    loss.backward()

    assert fsdp["loss"] == pytest.approx(loss.item(), rel=1e-6)
    adapters = 0
    for name, param in model.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(fsdp["grads"][name], param.grad, rtol=1e-5, atol=1e-7, msg=name)
            adapters += 1
        else:
            assert param.grad is None and fsdp["grads"][name] is None, name
    assert adapters == 2 * ADAPTED_LAYERS
