"""The model the recipe trains is in train mode with its decoder layers checkpointed, however it was loaded."""

from __future__ import annotations

import pytest
import torch

from trainlift.train.data import examples as data
from trainlift.train.model.build import apply_fsdp, decoder_layers, load_model
from trainlift.train.model.loss import token_loss_sum


def test_a_loaded_model_is_trained_with_activation_checkpointing(tiny_spec, single_process_group):
    """A resumed run skips the step-0 evaluation that used to flip the model into train mode: the layers must be
    recomputed in backward (checkpointed) straight after `apply_fsdp`, as on a fresh run."""
    spec = tiny_spec()
    loaded = load_model(spec.model, seed=0)  # from_pretrained: eval mode
    model = apply_fsdp(loaded, torch.device("cpu"), bf16=False, activation_checkpointing=True)
    layers = decoder_layers(model)
    forwards = []
    for layer in layers:  # the recompute stops once it has what backward needs: count the MLPs' starts
        layer.mlp.register_forward_pre_hook(lambda module, args: forwards.append(module))
    ids = list(range(3, 19))
    batch = data.collate([{"input_ids": ids, "labels": ids, "position_ids": list(range(len(ids)))}])

    assert len(layers) == 2 and model.training and all(layer.training for layer in layers)
    token_loss_sum(model, batch).backward()
    # Each checkpointed layer runs forward once in the forward pass and once more when backward recomputes it.
    assert len(forwards) == 2 * len(layers)


def test_an_untied_models_embedding_is_its_own_fsdp_group_and_a_tied_ones_stays_with_the_head(single_process_group):
    """The root group all-gathers first in forward and reduce-scatters last in backward, with nothing to overlap:
    an untied embedding (15% of Qwen2.5-1.5B's parameters with the head) gets its own group."""
    from torch.distributed.fsdp import FSDPModule
    from transformers import LlamaConfig, LlamaForCausalLM

    def sharded(tied: bool):
        config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=64, tie_word_embeddings=tied)
        return apply_fsdp(LlamaForCausalLM(config), torch.device("cpu"), bf16=False, activation_checkpointing=False)

    untied, tied = sharded(False), sharded(True)
    assert isinstance(untied.get_input_embeddings(), FSDPModule)
    assert not isinstance(tied.get_input_embeddings(), FSDPModule)  # it shares its weight with the root's head
    assert all(isinstance(layer, FSDPModule) for layer in decoder_layers(untied))


def test_rebuilding_unsaved_buffers_touches_only_them():
    """Gemma 3's scaled embedding and rotary tables are non-persistent buffers (one of them on a module with a
    parameter); rebuilding them after `to_empty` restores the built values and leaves every parameter alone."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainlift.train.model import weights

    config = AutoConfig.for_model("gemma3_text", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64)
    model = AutoModelForCausalLM.from_config(config)
    built = {name: buffer.clone() for name, buffer in model.named_buffers()}
    params = {name: (param, param.detach().clone()) for name, param in model.named_parameters()}
    assert "model.embed_tokens.embed_scale" in built
    for buffer in model.buffers():
        buffer.fill_(1e10)
    weights.rebuild_unsaved_buffers(model)
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, built[name]), name
    for name, param in model.named_parameters():
        assert param is params[name][0] and torch.equal(param, params[name][1]), name
