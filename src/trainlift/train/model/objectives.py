"""What a micro-batch's loss is (`train.objective`): next-token cross-entropy over trained tokens (SFT), plus, for a
mixture of experts whose config asks for it, the router's load-balancing loss; or DPO over the pairs of a preference
split, with its reward metrics. The recipe asks `loss_for(spec, model_config)` once and steps, evaluates and collates
through the `Objective` it returns."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from trainlift.train.data import examples as data
from trainlift.train.model import families, preference_loss
from trainlift.train.model.loss import token_loss_and_aux, token_loss_sum

DUMMY_ROW = {"input_ids": [0] * 8, "labels": [data.IGNORE] * 8, "position_ids": list(range(8)), "num_tokens": 0}


def sft_loss_sum(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    loss = token_loss_sum(model, batch)
    return loss, loss.new_zeros(0)


def sft_with_router_loss(model, batch: dict, coefficient: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed token loss plus `coefficient` times the router's load-balancing loss, and that loss as a metric.
    The model computes it once over the micro-batch's tokens (padding included, as with no attention mask), as a
    mean; weighted by the micro-batch's trained tokens, the step's division by the global count gives the model's
    own `loss + coefficient * aux_loss` for a micro-batch alone, and across micro-batches a token-weighted mean."""
    loss, aux = token_loss_and_aux(model, batch)
    if not torch.is_tensor(aux):  # a family whose forward computes none (Llama 4): its own loss adds nothing
        aux = loss.new_zeros(())
    weighted = aux.float() * batch["trainable_tokens"]
    return loss + coefficient * weighted, weighted.reshape(1)


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


def loss_for(spec, model_config=None) -> Objective:
    """The one place the objective is chosen; DPO's references are added once scored (the recipe's
    `reference_logps`). SFT adds an MoE router's load-balancing loss where `model_config` asks the model for it
    (`output_router_logits` and a coefficient, families.yaml `aux_loss_coefficients`), as the model's own loss
    does, and reports it as `aux_loss`."""
    if spec.train.objective == "dpo":
        return Objective(functools.partial(preference_loss.dpo_loss_sum, dpo=spec.train.dpo), "pairs",
                         preference_loss.METRICS, pairs=True)
    coefficient = router_loss_coefficient(model_config) if model_config is not None else 0.0
    if coefficient:
        return Objective(functools.partial(sft_with_router_loss, coefficient=coefficient), "trainable_tokens",
                         ("aux_loss",))
    return SFT


def router_loss_coefficient(model_config) -> float:
    """`families.aux_loss_coefficient` read from the text config, else from the top-level one."""

    def value_of(name: str):
        values = (config_value(config, name) for config in (model_config.get_text_config(), model_config))
        return next((value for value in values if value is not None), None)

    return families.aux_loss_coefficient(value_of)


def config_value(config, dotted: str):
    """The attribute `dotted` of `config`, through sub-configs (`ffn_config.moe_loss_weight`); None if absent."""
    for name in dotted.split("."):
        config = getattr(config, name, None)
    return config
