"""DPO's log-probs and loss beyond test_dpo_loss.py's packed batch: the model's own logits where its head cannot be
chunked, a first target that is trained, the first step (policy = reference), a one-token chosen reply, and the
bookkeeping of examples across rows."""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trainlift.config.job import DpoSection
from trainlift.train.data import examples as data
from trainlift.train.model import preference_loss

DPO_TESTS = runpy.run_path(str(Path(__file__).with_name("test_dpo_loss.py")))
tiny_model, packed_pairs, hand_logps = (DPO_TESTS[name] for name in ("tiny_model", "packed_pairs", "hand_logps"))


def pair_batch(reference=None):
    rows, pairs = packed_pairs()
    return preference_loss.with_pairs(data.collate(rows), rows, reference), pairs


def test_a_model_without_a_chunkable_head_scores_with_its_own_logits(monkeypatch):
    model = tiny_model()
    batch, pairs = pair_batch()
    with torch.no_grad():
        alone = torch.stack([hand_logps(model, ex) for pair in pairs for ex in pair])
        monkeypatch.setattr(preference_loss, "chunked_head", lambda model: False)
        plain = preference_loss.sequence_logps(model, batch)
    assert plain.shape == (8,)
    torch.testing.assert_close(plain, alone, rtol=1e-5, atol=1e-5)


def test_chunked_sums_count_every_target_the_first_one_too():
    torch.manual_seed(0)
    head = torch.nn.Linear(4, 6, bias=False)
    hidden = torch.randn(1, 8, 4)
    targets = torch.tensor([2, 5, 0, 1, 3, 4, 2])  # every position trained, the first included
    owners = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    with torch.no_grad():
        sums = preference_loss.chunked_example_sums(hidden, head, targets, owners, slots=3, chunk_elements=6 * 2)
        logps = F.log_softmax(head(hidden[0, :-1]), dim=-1).gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(sums, torch.stack([logps[:3].sum(), logps[3:].sum(), torch.tensor(0.0)]))


def test_at_the_first_step_every_reward_is_zero_and_no_pair_is_won():
    """Policy = reference: rewards 0, each pair's loss log 2, and a tie is no win (TRL counts chosen > rejected)."""
    model = tiny_model()
    batch, _ = pair_batch()
    with torch.no_grad():
        batch["reference_logps"] = preference_loss.sequence_logps(model, batch).double()
        total, sums = preference_loss.dpo_loss_sum(model, batch, DpoSection(beta=0.3))
    assert sums.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert float(total) == pytest.approx(4 * np.log(2), rel=1e-6)


def test_pair_losses_by_hand_with_a_one_token_chosen_reply():
    """beta 0.5, smoothing 0.2, SFT weight 0.3; policy (-2, -5), reference (-3, -4): chosen reward 0.5, rejected
    -0.5, margin 1; the chosen reply has 1 trained token, so its NLL term is 0.3 · 2 / 1."""
    policy, reference = torch.tensor([-2.0, -5.0]), torch.tensor([-3.0, -4.0], dtype=torch.float64)
    losses, chosen, rejected = preference_loss.pair_losses(policy, reference, torch.tensor([1, 4]),
                                                           DpoSection(beta=0.5, label_smoothing=0.2, sft_weight=0.3))
    want = -np.log(1 / (1 + np.exp(-1.0))) * 0.8 - np.log(1 / (1 + np.exp(1.0))) * 0.2 + 0.3 * 2 / 1
    assert losses.tolist() == pytest.approx([want], rel=1e-6)
    assert (chosen.tolist(), rejected.tolist()) == ([0.5], [-0.5])
    no_reply = preference_loss.pair_losses(policy, reference, torch.tensor([0, 4]), DpoSection(sft_weight=0.3))[0]
    assert torch.isfinite(no_reply).all()  # a reply of no trained token divides by 1, not 0


def test_examples_are_counted_and_gathered_across_rows():
    packed = SimpleNamespace(rows=[{}, {}, {}], examples_per_row=[[0, 1], [2, 3, 4], [5]])
    assert preference_loss.example_count(packed) == 6
    assert preference_loss.example_count(SimpleNamespace(rows=[], examples_per_row=[])) == 0
    gathered = preference_loss.examples_of_rows(packed, [2, 0])
    assert gathered.tolist() == [5, 0, 1] and gathered.dtype == np.int64
    assert preference_loss.examples_of_rows(packed, []).dtype == np.int64  # an empty slice indexes too


def test_a_chunkable_head_never_holds_the_whole_logits():
    """The point of chunking: the model's own forward is asked for no logits (a chunk at a time runs the head)."""
    model = tiny_model()
    batch, _ = pair_batch()
    outputs = []
    model.register_forward_hook(lambda module, args, output: outputs.append(output))
    with torch.no_grad():
        preference_loss.sequence_logps(model, batch)
    assert [tuple(o.logits.shape) for o in outputs] == [(2, 0, 96)]
