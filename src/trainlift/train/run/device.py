"""A worker's tensors onto its device, and sums over every worker left there."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_sum(values: list[float] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """The sum over workers, left on the device (float64): reading it is the caller's one host sync."""
    t = torch.as_tensor(values, dtype=torch.float64).to(device)
    dist.all_reduce(t)
    return t


def to_device(batch: dict, device) -> dict:
    """Tensors onto `device`: from pinned memory and without waiting, on a GPU (the copy overlaps compute)."""
    if device.type != "cuda":
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return {k: v.pin_memory().to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()}
