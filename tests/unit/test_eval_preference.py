"""`trainlift eval` on preference pairs: each reply scored as the DPO trainer scores it (the same tokenization, the
same sequence log-probs as its packed rows), rewards against a reference model, and one clear line for bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from trainlift.cli import app
from trainlift.errors import UsageError
from trainlift.evaluate_preference import preference_accuracy
from trainlift.train.data import examples as data, preference
from trainlift.train.model import preference_loss

REPO = Path(__file__).resolve().parents[2]
PAIRS = REPO / "examples" / "data" / "prefs-eval.jsonl"


@pytest.fixture(scope="module")
def models(tiny_assets, tmp_path_factory):
    """The tiny model as the reference, and a policy moved away from it (its weights nudged by seeded noise)."""
    root = tmp_path_factory.mktemp("pref")
    policy_dir = root / "policy"
    shutil.copytree(tiny_assets / "model", policy_dir)
    policy = AutoModelForCausalLM.from_pretrained(policy_dir)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    policy.save_pretrained(policy_dir)
    return str(policy_dir), str(tiny_assets / "model")


def trainer_logps(model_dir: str, rows: list[dict]) -> torch.Tensor:
    """Every example's log-prob as the DPO trainer computes it: pairs packed into rows, one forward per batch."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    packed = list(preference.pack_pairs(preference.to_pairs(rows, tokenizer), 128, data.pad_id_of(tokenizer)))
    batch_rows = [row for row, _, _ in packed]
    batch = preference_loss.with_pairs(data.collate(batch_rows), batch_rows)
    with torch.no_grad():
        return preference_loss.sequence_logps(model, batch).double()


def test_rewards_equal_the_trainers_figures_for_the_same_pairs(models):
    policy, reference = models
    rows = [json.loads(line) for line in PAIRS.read_text().splitlines()[:10]]
    report = preference_accuracy(policy, str(PAIRS), reference=reference, beta=0.3, limit=10, batch_size=4)
    assert (report["total"], report["score"], report["beta"]) == (10, "reward", 0.3)
    rewards = 0.3 * (trainer_logps(policy, rows) - trainer_logps(reference, rows))
    margins = (rewards[0::2] - rewards[1::2]).tolist()
    assert [s["margin"] for s in report["samples"]] == pytest.approx(margins, rel=1e-4, abs=1e-4)
    assert report["correct"] == sum(m > 0 for m in margins)
    assert 0 < report["correct"] < 10  # noise, not training: some pairs each way
    assert report["accuracy"] == report["correct"] / 10
    assert report["mean_margin"] == pytest.approx(sum(margins) / 10, rel=1e-4, abs=1e-4)

    alone = preference_accuracy(policy, str(PAIRS), limit=10, batch_size=4)  # no reference: log-probs
    logps = trainer_logps(policy, rows)
    assert alone["score"] == "log-prob" and alone["beta"] is None
    assert [s["chosen"] for s in alone["samples"]] == pytest.approx(logps[0::2].tolist(), rel=1e-4, abs=1e-4)

    same = preference_accuracy(reference, str(PAIRS), reference=reference, limit=4)
    assert same["correct"] == 0 and same["mean_margin"] == 0  # a model against itself prefers nothing


def test_the_cli_reports_pairs_and_refuses_bad_input_in_one_line(models, tmp_path):
    policy, reference = models
    runner = CliRunner()
    shown = runner.invoke(app, ["eval", policy, "--data", str(PAIRS), "--reference", reference, "--limit", "6",
                                "--show", "2"])
    assert shown.exit_code == 0, shown.output
    assert "chosen preferred in" in shown.output and "by reward, beta 0.1" in shown.output
    as_json = json.loads(runner.invoke(app, ["eval", policy, "--data", str(PAIRS), "--limit", "3", "--json"]).stdout)
    assert as_json["total"] == 3 and len(as_json["samples"]) == 3

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "p", "chosen": "c", "rejected": 3}) + "\n")
    with pytest.raises(UsageError, match=r"bad.jsonl:1: rejected must be text or a list"):
        preference_accuracy(policy, str(bad))
    with pytest.raises(UsageError, match="--reference .*: not an HF model directory"):
        preference_accuracy(policy, str(PAIRS), reference=str(tmp_path), limit=2)
    sft = runner.invoke(app, ["eval", policy, "--data", str(REPO / "examples" / "data" / "tasks-eval.jsonl"),
                              "--reference", reference])
    assert isinstance(sft.exception, UsageError) and "--reference scores those only" in str(sft.exception)
