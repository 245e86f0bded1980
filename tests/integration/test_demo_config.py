"""The shipped demo config trains on the embedded Ray cluster and its export answers prompts."""

import json

import pytest
from typer.testing import CliRunner

from trainlift.cli import app

pytestmark = pytest.mark.usefixtures("ray_local")
REPO_EXAMPLE = "examples/tiny-local.yaml"


def test_demo_config_lowers_eval_loss_and_exports_a_model_that_answers(tmp_path, monkeypatch):
    import os

    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    runner = CliRunner()
    result = runner.invoke(app, [
        "train", REPO_EXAMPLE, "--steps", "40", "--run-dir", str(tmp_path / "runs"),
        "--set", f"model.path={tmp_path / 'tiny-base'}", "--set", "train.eval_every=0", "--json",
    ])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout[result.stdout.index("{"):])
    assert summary["finished"] and summary["steps"] == 40
    assert summary["eval_loss"] < 0.6 * summary["initial_eval_loss"]
    assert summary["tokens_per_s"] > 0 and summary["mfu"] is None  # CPU: no known peak

    final = tmp_path / "runs" / "tiny-demo" / "final"
    result = runner.invoke(app, ["eval", str(final), "--data", "examples/data/tasks-eval.jsonl", "--limit", "8", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    samples = report["samples"]
    assert report["total"] == len(samples) == 8
    # The exact-match score itself (real matches and misses, against plain `generate` on each prompt alone) is
    # checked in tests/unit/test_evaluate.py on a model trained until it answers: 40 steps here answer none right.
    # 40 steps teach the answers' form, not yet their content: digits for add, spaced digits or letters for
    # sort and reverse (measured: 8 of 8 after 40 steps; the untrained base model: 0 of 8).
    assert sum(answer_form(s["answer"]) == answer_form(s["expected"]) for s in samples) >= 6, samples


def answer_form(text: str) -> tuple[str, bool]:
    chars = text.replace(" ", "")
    return ("digits" if chars.isdigit() else "letters" if chars.isalpha() else "other"), " " in text.strip()
