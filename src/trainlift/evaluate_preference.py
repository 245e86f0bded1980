"""`trainlift eval` on preference pairs ({prompt, chosen, rejected}): how often the model prefers the chosen reply.

Each reply's sequence log-prob is the sum of its tokens' log-probs given the prompt, tokenized, packed and scored as
DPO training does it (preference.py, preference_loss.py), so the figures match the run's own. With `reference` (the model the DPO run started
from) a reply's reward is beta * (log pi - log pi_ref), as training reports it, and a pair counts as preferred when
the chosen reply's reward is higher; without one, when its log-prob is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from trainlift.errors import UsageError
from trainlift.evaluate import first_row
from trainlift.train.data import preference, source as datasource
from trainlift.train.data.examples import collate, pad_id_of
from trainlift.train.model import preference_loss
from trainlift.train.run.device import to_device


def is_preference_file(path: str) -> bool:
    """Whether the file's first row is a preference pair."""
    row = first_row(path)
    return isinstance(row, dict) and set(preference.KEYS) <= row.keys()


def sequence_logps(model, pairs: Sequence[preference.Pair], pad_id: int, device, batch_size: int) -> list[float]:
    """Each example's sequence log-prob (chosen, rejected, chosen, ...) as the DPO trainer computes it: pairs packed
    whole into rows as long as the longest pair (none cut), `batch_size` rows to a forward."""
    seq_len = max(len(chosen.input_ids) + len(rejected.input_ids) for chosen, rejected in pairs)
    rows = [row for row, _, _ in preference.pack_pairs(pairs, seq_len, pad_id)]
    sums: list[float] = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        batch = to_device(preference_loss.with_pairs(collate(chunk), chunk), device)
        with torch.no_grad():
            sums += preference_loss.sequence_logps(model, batch).tolist()
    return sums


def _pairs(data_file: str, limit: int) -> list[dict]:
    """The file's first `limit` rows, each checked as a preference pair (errors name file:line)."""
    rows: list[dict] = []
    for where, row in datasource.iter_rows(datasource.resolve(data_file, "--data")):
        preference.check_row(row, where)
        rows.append(row)
        if len(rows) == limit:
            break
    if not rows:
        raise UsageError(f"--data {data_file}: no preference pairs in the file")
    return rows


def _model(model_dir: str, flag: str, device):
    from transformers import AutoModelForCausalLM

    if not (Path(model_dir) / "config.json").is_file():
        raise UsageError(f"{flag} {model_dir}: not an HF model directory (no config.json)",
                         hint="point at <run>/final after `trainlift train`, or at the model the run started from")
    return AutoModelForCausalLM.from_pretrained(model_dir).to(device).eval()


def preference_accuracy(model_dir: str, data_file: str, reference: str | None = None, beta: float = 0.1,
                        limit: int = 200, batch_size: int = 16) -> dict[str, Any]:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    if beta <= 0:
        raise UsageError(f"--beta {beta}: must be above 0")
    if limit < 1:
        raise UsageError(f"--limit {limit}: must be at least 1")
    rows = _pairs(data_file, limit)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hf_logging.disable_progress_bar()
    policy = _model(model_dir, "model", device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pairs = preference.to_pairs(rows, tokenizer)
    pad_id = pad_id_of(tokenizer)
    logps = sequence_logps(policy, pairs, pad_id, device, batch_size)
    if reference is not None:
        reference_logps = sequence_logps(_model(reference, "--reference", device), pairs, pad_id, device, batch_size)
        scores = [beta * (p - r) for p, r in zip(logps, reference_logps)]
    else:
        scores = logps
    samples = []
    for row, chosen, rejected in zip(rows, scores[0::2], scores[1::2]):
        prompt = row["prompt"] if isinstance(row["prompt"], str) else row["prompt"][-1]["content"]
        samples.append({"prompt": prompt, "chosen": chosen, "rejected": rejected, "margin": chosen - rejected,
                        "correct": chosen > rejected})
    correct = sum(s["correct"] for s in samples)
    return {"model": model_dir, "reference": reference, "beta": beta if reference else None,
            "score": "reward" if reference else "log-prob", "total": len(samples), "correct": correct,
            "accuracy": correct / len(samples), "mean_margin": sum(s["margin"] for s in samples) / len(samples),
            "samples": samples}
