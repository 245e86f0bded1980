"""What a micro-batch's loss is (`train.objective`): next-token cross-entropy over trained tokens (SFT), or DPO over
the pairs of a preference split, with its reward metrics. The recipe asks `loss_for(spec)` once and steps, evaluates
and collates through the `Objective` it returns."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from trainlift.train.data import examples as data
from trainlift.train.model import preference_loss
from trainlift.train.model.loss import token_loss_sum

DUMMY_ROW = {"input_ids": [0] * 8, "labels": [data.IGNORE] * 8, "position_ids": list(range(8)), "num_tokens": 0}


def sft_loss_sum(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    loss = token_loss_sum(model, batch)
    return loss, loss.new_zeros(0)


@dataclass(frozen=True)
class Objective:
    """What a micro-batch's loss is (`train.objective`): `loss(model, batch)` gives the loss summed over the batch
    and the sums of its `metrics`, both divided by the global batch's sum of `batch[normaliser]` (trainable tokens;
    DPO: pairs). DPO batches carry their examples' reference log-probs, per split in `references`."""

    loss: Callable[[Any, dict], tuple[torch.Tensor, torch.Tensor]]
    normaliser: str
    metrics: tuple[str, ...] = ()
    pairs: bool = False
    references: dict[str, np.ndarray] | None = None

    def collate(self, rows: list[dict], indices: list[int], reference: np.ndarray | None = None) -> dict:
        """`rows` (rows `indices` of a split) as one batch that knows its rows' indices."""
        batch = {**data.collate(rows), "row_index": torch.as_tensor(indices, dtype=torch.long)}
        return preference_loss.with_pairs(batch, rows, reference) if self.pairs else batch

    def batch_of(self, packed: data.Packed, indices: list[int], split: str = "train") -> dict:
        rows = [packed.rows[j] for j in indices]
        if self.references is None:
            return self.collate(rows, indices)
        return self.collate(rows, indices, self.references[split][preference_loss.examples_of_rows(packed, indices)])


SFT = Objective(sft_loss_sum, "trainable_tokens")


def loss_for(spec) -> Objective:
    """The one place the objective is chosen; DPO's references are added once scored (the recipe's
    `reference_logps`)."""
    if spec.train.objective == "dpo":
        return Objective(functools.partial(preference_loss.dpo_loss_sum, dpo=spec.train.dpo), "pairs",
                         preference_loss.METRICS, pairs=True)
    return SFT
