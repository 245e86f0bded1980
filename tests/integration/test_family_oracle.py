"""Every causal LM type of the installed transformers (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`) against the model's own
loss (tests/family_oracle.py: a tiny random model, two packed rows of examples, five tokens a chunk, each example
alone through `model(input_ids, labels=...)`): a family matches, loss and gradients, exactly when families.yaml
does not refuse it, so the refused list can go stale in neither direction; and every mixture of experts that can
add its router's load-balancing loss adds it as its own loss does. About half a minute on two idle CPU cores."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from trainlift.train.model import families

ROOT = Path(__file__).resolve().parents[2]
oracle = runpy.run_path(str(ROOT / "tests" / "family_oracle.py"))


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@pytest.mark.parametrize("family", causal_lm_types())
def test_a_family_matches_its_own_loss_exactly_when_it_is_not_refused(family):
    """Tolerances (fp32, only the order of reductions differs): the summed loss within rtol 1e-5, every gradient
    within 1e-4 of the largest own gradient; refused families miss by far more (the closest: 5e-4)."""
    comparison = oracle["compare"](family)
    refused = families.refused().get(family)
    if refused is None:
        assert comparison.matches, f"{comparison.line()}: refuse it in families.yaml with why, or fix the loss"
    else:
        assert not comparison.matches, f"{comparison.line()}: it matches now, so families.yaml need not refuse it " \
                                       f"({refused})"


def with_router_loss() -> list[str]:
    """The families trainlift trains whose config has the switch for the router's loss (`output_router_logits`)."""
    with oracle["quiet"]():
        return [f for f in causal_lm_types() if f not in families.refused() and oracle["router_fields"](f) is not None]


@pytest.mark.parametrize("family", with_router_loss())
def test_a_family_that_can_add_its_routers_loss_adds_it_as_its_own_loss_does(family):
    """With `output_router_logits` on and every coefficient families.yaml names set, trainlift's SFT objective over
    a micro-batch of two unpacked rows is the model's own `loss`, gradients too (same tolerances). A family whose
    forward computes no router loss (Llama 4) adds none, as its own loss does."""
    with oracle["quiet"]():
        model = oracle["tiny_model"](family, **oracle["router_fields"](family))
        comparison, _, _ = oracle["compare_router_loss"](family, model)
    assert comparison.matches, comparison.line()
