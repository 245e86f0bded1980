"""Asynchronous checkpoints stage each rank's state in pinned host memory, shared through /dev/shm only where the
node's /dev/shm holds every rank's state at once (the 1.5B full fine-tune stages ~18.5 GB a node; a container's
default /dev/shm is 64 MiB, and on EKS it is a memory-backed volume Ray's object store shares)."""

from __future__ import annotations

import logging

import torch

from trainlift.train.run import saving

GIB = 2**30


def test_shared_memory_is_used_only_where_every_rank_of_the_node_fits(caplog, monkeypatch):
    monkeypatch.setattr(saving, "_said_shm", [])
    assert saving.shared_memory_fits(2 * GIB, ranks=4, free_bytes=10 * GIB)
    with caplog.at_level(logging.WARNING, logger="trainlift.train.run.saving"):
        assert not saving.shared_memory_fits(2 * GIB, ranks=8, free_bytes=10 * GIB)
        assert not saving.shared_memory_fits(2 * GIB, ranks=8, free_bytes=10 * GIB)  # said once
    [record] = caplog.records
    assert "/dev/shm has 10.0 GiB free, 8 rank(s) of this node stage 2.0 GiB each" in record.getMessage()
    assert not saving.shared_memory_fits(1, ranks=1, free_bytes=None)  # no /dev/shm to share through


def test_a_ranks_state_counts_its_own_shard_of_every_tensor():
    state = {"model": {"w": torch.zeros(4, 8), "b": torch.zeros(8, dtype=torch.bfloat16)},
             "optim": {"state": {"w": {"exp_avg": torch.zeros(4, 8), "step": 3}}, "param_groups": [{"lr": 1e-3}]}}
    assert saving.state_bytes(state) == 4 * 8 * 4 + 8 * 2 + 4 * 8 * 4
    assert saving.local_ranks() >= 1 and (saving.shm_free_bytes() or 0) >= 0
