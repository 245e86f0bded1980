"""The model the recipe trains is in train mode with its decoder layers checkpointed, however it was loaded."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from trainlift.train.data import examples as data
from trainlift.train.model.build import apply_fsdp, decoder_layers, load_model
from trainlift.train.recipe import token_loss_sum


@pytest.fixture
def single_process_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_loaded_model_is_trained_with_activation_checkpointing(tiny_spec, single_process_group):
    """A resumed run skips the step-0 evaluation that used to flip the model into train mode: the layers must be
    recomputed in backward (checkpointed) straight after `apply_fsdp`, as on a fresh run."""
    spec = tiny_spec()
    loaded = load_model(spec.model, seed=0)  # from_pretrained: eval mode
    model = apply_fsdp(loaded, torch.device("cpu"), bf16=False, activation_checkpointing=True)
    layers = decoder_layers(model)
    forwards = []
    for layer in layers:
        layer.register_forward_hook(lambda module, args, out: forwards.append(module))
    ids = list(range(3, 19))
    batch = data.collate([{"input_ids": ids, "labels": ids, "position_ids": list(range(len(ids)))}])

    assert model.training and all(layer.training for layer in layers)
    token_loss_sum(model, batch).backward()
    # Each checkpointed layer runs forward once in the forward pass and once more when backward recomputes it.
    assert len(forwards) == 2 * len(layers)
