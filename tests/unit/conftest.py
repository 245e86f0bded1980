"""Fixtures of the unit tests."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist


@pytest.fixture
def single_process_group():
    """A one-process gloo group: what FSDP2 and the recipe's collectives need, without Ray."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
