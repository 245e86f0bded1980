"""train.compile and model.activation_checkpointing (none, full, selective; keeping inputs or matmul outputs):
the recipe's loss and gradients stay those of the eager, unchecked model on packed rows, selective checkpoints
exactly the blocks it names, the older boolean specs still validate, and the estimate orders the modes' memory
and recompute as the recipe spends them.

Packed examples stay apart through all of it: the losses equal the eager model's, which keeps them apart
(test_packed_attention.py). Each compiled model costs tens of seconds here, so two tests compile."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from trainlift import catalog
from trainlift.config.job import LoraSection, ModelSection, apply_overrides, validate_job_spec
from trainlift.errors import SpecError
from trainlift.estimate.plan import Target, plan
from trainlift.estimate.shape import shape_of
from trainlift.estimate.timing import hardware_flops_per_token
from trainlift.train.data import examples as data
from trainlift.train.model import lora
from trainlift.train.model.build import BlockCheckpointing, apply_fsdp, checkpointed_layers, decoder_layers
from trainlift.train.model.loss import token_loss_sum
from trainlift.train.run.spec_record import training_fields

REPO = Path(__file__).resolve().parents[2]
TINY = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, vocab_size=96)
CPU = torch.device("cpu")


def tiny_model(layers: int = 4, model_type: str = "llama", with_lora: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **TINY, num_hidden_layers=layers))
    if with_lora:
        model = lora.apply(model, LoraSection(r=4))
        with torch.no_grad():  # peft starts B at zero, which would leave every A without a gradient
            for name, param in model.named_parameters():
                if ".lora_B." in name:
                    param.normal_(std=0.1)
    return model


def packed_batch() -> dict[str, torch.Tensor]:
    """Two rows of 24 tokens holding five examples, each restarting its position ids."""
    generator = torch.Generator().manual_seed(2)
    examples = [data.Example(ids, ids) for ids in
                (torch.randint(0, TINY["vocab_size"], (n,), generator=generator).tolist() for n in (10, 5, 9, 4, 20))]
    rows = data.pack(examples, seq_len=24, pad_id=0).rows
    assert len(rows) == 2
    return data.collate(rows)


def loss_and_gradients(model, checkpointing, compile_blocks: bool = False):
    """The first step's loss and every gradient of a sharded copy of `model` (same weights every time)."""
    sharded = apply_fsdp(copy.deepcopy(model), CPU, bf16=False, activation_checkpointing=checkpointing,
                         compile_blocks=compile_blocks)
    loss = token_loss_sum(sharded, packed_batch())
    loss.backward()
    grads = {name: p.grad.full_tensor() for name, p in sharded.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def assert_same(expected, actual, rtol: float, atol: float) -> None:
    (loss, grads), (other_loss, other_grads) = expected, actual
    torch.testing.assert_close(other_loss, loss, rtol=rtol, atol=atol)
    assert other_grads.keys() == grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(other_grads[name], grad, rtol=rtol, atol=atol, msg=name)


def test_the_boolean_form_still_validates_as_full_and_none():
    def mode(value):
        return ModelSection(config={"model_type": "llama"}, tokenizer="t", activation_checkpointing=value)

    assert mode(True).activation_checkpointing == "full" and mode(False).activation_checkpointing == "none"
    assert mode("selective").activation_checkpointing_every == 2
    spec = spec_with("model.activation_checkpointing=true", "train.compile=true")
    assert spec.model.activation_checkpointing == "full" and spec.train.compile
    assert spec_with("model.activation_checkpointing=false").model.activation_checkpointing == "none"
    with pytest.raises(SpecError, match="model.activation_checkpointing: Input should be 'none', 'full' or"):
        spec_with("model.activation_checkpointing=some")
    with pytest.raises(SpecError, match="model.activation_checkpointing_every"):
        spec_with("model.activation_checkpointing_every=0")


def spec_with(*overrides: str):
    raw = {"model": {"config": {"model_type": "llama"}, "tokenizer": "t"}, "data": {"train": "t.jsonl"}}
    return validate_job_spec(apply_overrides(raw, overrides))


def test_compiling_and_checkpointing_may_change_between_resumes():
    changed = spec_with("train.compile=true", "model.activation_checkpointing=selective",
                        "model.activation_checkpointing_every=3", "model.activation_checkpointing_keeps=matmuls")
    assert training_fields(changed, "x") == training_fields(spec_with(), "x")


def test_selective_checkpoints_exactly_every_nth_block(single_process_group):
    model = tiny_model(layers=6)
    for checkpointing, expected in ((BlockCheckpointing("selective", every=3), [2, 5]),
                                    (BlockCheckpointing("selective", every=2), [1, 3, 5]),
                                    (BlockCheckpointing("full"), [0, 1, 2, 3, 4, 5]), (False, [])):
        sharded = apply_fsdp(copy.deepcopy(model), CPU, bf16=False, activation_checkpointing=checkpointing)
        assert checkpointed_layers(sharded) == expected
        starts = []
        for i, layer in enumerate(decoder_layers(sharded)):  # a recompute stops once backward has what it needs
            layer.mlp.register_forward_pre_hook(lambda module, args, i=i: starts.append(i))
        token_loss_sum(sharded, packed_batch()).backward()
        assert sorted(starts) == sorted([*range(6), *expected]), checkpointing  # checkpointed blocks run twice


@pytest.mark.parametrize("mode, keeps, with_lora", [
    ("full", "inputs", False), ("selective", "inputs", False), ("full", "matmuls", False),
    ("selective", "matmuls", True)])
def test_checkpointing_gives_the_loss_and_gradients_of_none(single_process_group, mode, keeps, with_lora):
    model = tiny_model(with_lora=with_lora)
    unchecked = loss_and_gradients(model, BlockCheckpointing("none"))
    assert_same(unchecked, loss_and_gradients(model, BlockCheckpointing(mode, every=2, keeps=keeps)),
                rtol=1e-6, atol=1e-7)


def compiled_run(model, checkpointing):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    result = loss_and_gradients(model, checkpointing, compile_blocks=True)
    return result, counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def test_compiled_blocks_give_the_eager_loss_and_gradients(single_process_group):
    """Selective checkpointing around compiled blocks: the checkpointed and the plain blocks share one graph."""
    model = tiny_model(model_type="qwen2")
    eager = loss_and_gradients(model, BlockCheckpointing("none"))
    compiled, graphs, breaks = compiled_run(model, BlockCheckpointing("selective", every=2))
    assert (graphs, breaks) == (1, 0)
    assert abs(compiled[0].item() - eager[0].item()) <= 1e-4
    assert_same(eager, compiled, rtol=1e-4, atol=1e-5)


def test_compiled_lora_blocks_keeping_matmul_outputs_give_the_eager_loss_and_gradients(single_process_group):
    """peft-wrapped blocks compiled around a checkpoint that keeps matmul outputs (the compiler applies the policy):
    two graphs, one for the first block, whose input (the frozen embedding's output) needs no gradient, one for the
    others."""
    model = tiny_model(with_lora=True)
    eager = loss_and_gradients(model, BlockCheckpointing("none"))
    compiled, graphs, breaks = compiled_run(model, BlockCheckpointing("full", keeps="matmuls"))
    assert (graphs, breaks) == (2, 0)
    assert abs(compiled[0].item() - eager[0].item()) <= 1e-4
    assert_same(eager, compiled, rtol=1e-4, atol=1e-5)


def llama_8b():
    from trainlift.ops.model_config import read_config_file

    return shape_of(read_config_file(REPO / "examples" / "model-configs" / "llama-3.1-8b.json"))


def llama_8b_on_p5(*overrides: str):
    """torchtitan's anchor (docs/BENCHMARKS.md benchmark 17): Llama-3.1-8B, sequence 8192, micro-batch 2, one p5."""
    raw = {"model": {"config": {"model_type": "llama"}, "tokenizer": "t"},
           "data": {"train": "t.jsonl", "seq_len": 8192}, "train": {"micro_batch_size": 2},
           "scaling": {"workers": "auto"}}
    return plan(validate_job_spec(apply_overrides(raw, list(overrides))), llama_8b(),
                Target(catalog.lookup("p5.48xlarge"), 1, usd_per_hour=55.0, price_source="test"))


def test_the_estimate_orders_activation_memory_none_selective_full_and_recompute_the_other_way():
    modes = {"none": (), "selective": ("model.activation_checkpointing=selective",),
             "full": ("model.activation_checkpointing=full",),
             "full keeping matmuls": ("model.activation_checkpointing=full",
                                      "model.activation_checkpointing_keeps=matmuls")}
    estimates = {name: llama_8b_on_p5(*overrides) for name, overrides in modes.items()}
    memory = {name: e.items["activations"] for name, e in estimates.items()}
    assert memory["none"] > memory["selective"] > memory["full keeping matmuls"] > memory["full"]
    executed = {name: hardware_flops_per_token(llama_8b(), e.workload) for name, e in estimates.items()}
    assert executed["none"] == executed["full keeping matmuls"] < executed["selective"] < executed["full"]
    assert estimates["selective"].to_dict()["activation_checkpointing"] == "selective (1 layer in 2, keeping inputs)"


def test_the_estimate_advises_selective_before_full_and_scales_the_assumed_mfu_when_compiled():
    unchecked = llama_8b_on_p5()
    changes = [a.change for a in unchecked.advice]
    assert not unchecked.fits and "model.activation_checkpointing: selective (1 layer in 2)" in changes
    assert "model.activation_checkpointing: full" not in changes  # selective fits: no need to recompute every layer
    assert llama_8b_on_p5("model.activation_checkpointing=selective").fits
    compiled = llama_8b_on_p5("train.compile=true", "model.activation_checkpointing=selective")
    assert compiled.hfu.value == pytest.approx(0.367 * 1.157) and "train.compile" in compiled.hfu.label
    assert compiled.items == llama_8b_on_p5("model.activation_checkpointing=selective").items
