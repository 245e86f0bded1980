"""A training step reads the device back once: after the optimizer step is queued, for the figures it logs.
Every other host read (`.item()`, `.tolist()`, `float()`, `int()`, `bool()` of a tensor) waits for the GPU
to drain and stops the next micro-batch's all-gather from overlapping compute. On the CPU there is nothing to
wait for, so this counts the reads trainlift's own code makes in one step (the model's own code is not
counted), on a one-process gloo group."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

SRC = str(Path(__file__).resolve().parents[2] / "src" / "trainlift")
READS = ("item", "tolist", "__float__", "__int__", "__bool__")


def tiny_fsdp_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainlift.train.model.build import apply_fsdp

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=64, tie_word_embeddings=False)
    return apply_fsdp(LlamaForCausalLM(config), torch.device("cpu"), bf16=False, activation_checkpointing=False)


def packed_rows(n: int) -> list[dict]:
    """Rows of two packed examples each, prompts masked, as the data pipeline makes them."""
    rows = []
    for i in range(n):
        ids = [(7 * i + t) % 64 for t in range(16)]
        labels = [-100] * 3 + ids[3:8] + [-100] * 3 + ids[11:]
        rows.append({"input_ids": ids, "labels": labels, "position_ids": list(range(8)) * 2, "num_tokens": 16})
    return rows


def counting_reads(monkeypatch) -> list[str]:
    calls: list[str] = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(SRC):
                calls.append(f"{_name} in {Path(caller).name}:{sys._getframe(1).f_lineno}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return calls


def test_a_training_step_reads_the_device_once(single_process_group, monkeypatch):
    from trainlift.train.data.examples import collate
    from trainlift.train.recipe import train_step

    model = tiny_fsdp_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    rows = packed_rows(4)
    batches = [collate(rows[:2]), collate(rows[2:])]  # two micro-batches
    train_step(model, optimizer, scheduler, batches, 1.0, 1, torch.device("cpu"))  # warm-up
    reads = counting_reads(monkeypatch)
    result = train_step(model, optimizer, scheduler, batches, 1.0, 1, torch.device("cpu"))
    assert len(reads) == 1, reads
    assert reads[0].startswith("tolist in recipe.py")
    assert result.tokens == 64 and result.loss > 0 and result.grad_norm > 0 and result.stop is False
    assert result.attended == 4 * (8 ** 2 + 8 ** 2)  # two 8-token examples a row: MFU's attention term
