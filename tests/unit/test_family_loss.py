"""trainlift's loss against the model's own `model(input_ids, labels=...)` (tests/family_oracle.py; every family in
tests/integration/test_family_oracle.py): families whose causal LM post-processes its logits (Gemma2's soft-cap,
Granite's and Cohere's scaling), the demo's tiny Qwen2, DPO's log-probs, an MoE router's load-balancing loss, and the
refusal of the families that cannot match, as the driver gives it and as docs/training.md lists it."""

from __future__ import annotations

import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trainlift.errors import UsageError
from trainlift.train.data import examples as data, preference
from trainlift.train.model import families, loss, objectives, preference_loss

ROOT = Path(__file__).resolve().parents[2]
oracle = runpy.run_path(str(ROOT / "tests" / "family_oracle.py"))
TINY_CONFIG = runpy.run_path(str(ROOT / "tests" / "conftest.py"))["TINY_CONFIG"]
POST_PROCESSED = ["gemma2", "granite", "cohere"]  # soft-cap, divide, multiply: each missed before


@pytest.mark.parametrize("family", [*POST_PROCESSED, "qwen2"])
def test_a_family_matches_its_own_loss_and_gradients_example_by_example(family):
    """Two packed rows of examples, five tokens a chunk, against each example alone through the model's own loss.
    Tolerances (fp32, only the order of reductions differs): summed loss rtol 1e-5; every gradient within 1e-4 of
    the largest own gradient."""
    comparison = oracle["compare"](family)
    assert comparison.matches, comparison.line()


def demo_model():
    from transformers import AutoTokenizer

    from trainlift.train.model.build import random_model

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "examples" / "tiny" / "tokenizer")
    return random_model(TINY_CONFIG, tokenizer, seed=0).train()


def test_the_demo_models_loss_is_its_own_plain_and_per_packed_example():
    """The demo's tiny Qwen2 (tied head): one example alone, through the chunked loss and through the plain one on the
    model's logits, is the model's own mean loss times its trained tokens; packed examples are each scored as alone.
    Each position is scored against the next token, as transformers does."""
    model = demo_model()
    example = oracle["examples"](model.config.vocab_size)[3]
    alone = data.collate(data.pack([example], len(example.input_ids), pad_id=0).rows)
    ids, labels = torch.tensor([example.input_ids]), torch.tensor([example.labels])
    own = model(input_ids=ids, labels=labels).loss * alone["trainable_tokens"]
    torch.testing.assert_close(loss.token_loss_sum(model, alone), own, rtol=1e-5, atol=0)
    torch.testing.assert_close(loss.plain_token_loss_sum(model(input_ids=ids).logits, labels), own, rtol=1e-5, atol=0)
    comparison = oracle["compare_model"]("qwen2 (demo)", model)
    assert comparison.matches, comparison.line()


def own_logps(model, example: data.Example) -> torch.Tensor:
    """The sum over the example's trained tokens of log_softmax of the model's own logits, predicting the next one."""
    logits = model(input_ids=torch.tensor([example.input_ids]), use_cache=False).logits[0, :-1]
    targets = torch.tensor(example.labels[1:])
    token_logps = F.log_softmax(logits.float(), dim=-1).gather(1, targets.clamp(min=0)[:, None])[:, 0]
    return (token_logps * (targets != data.IGNORE)).sum()


@pytest.mark.parametrize("family", POST_PROCESSED)
def test_dpo_log_probs_are_the_log_softmax_of_the_models_own_logits(family):
    """DPO's sequence log-probs of packed pairs (several chunks) against each example alone through the model's own
    post-processed logits; tolerance rtol 1e-5, atol 1e-4 (sums of ~10 log-probs near -5 each)."""
    with oracle["quiet"]():
        model = oracle["tiny_model"](family)
    examples = oracle["examples"](oracle["vocab_of"](model))[:4]
    pairs = [(examples[0], examples[1]), (examples[2], examples[3])]
    rows = [row for row, _, _ in preference.pack_pairs(pairs, seq_len=18, pad_id=0)]
    batch = preference_loss.with_pairs(data.collate(rows), rows)
    head_rows = model.get_output_embeddings().weight.size(0)
    with torch.no_grad():
        ours = preference_loss.sequence_logps(model, batch, chunk_elements=4 * head_rows)
        own = torch.stack([own_logps(model, ex) for pair in pairs for ex in pair])
    torch.testing.assert_close(ours, own, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_an_moe_adds_its_routers_load_balancing_loss_as_its_own_loss_does(family):
    """A micro-batch of two unpacked rows: trainlift's SFT loss over its trained tokens is the model's own
    `loss` (mean token loss + router_aux_loss_coef * aux_loss), gradients too, and `aux_loss` is reported apart.
    Tolerances as the family comparison's: rtol 1e-5 on the loss, 1e-4 of the largest gradient."""
    with oracle["quiet"]():
        model = oracle["tiny_model"](family, **oracle["router_fields"](family))
        comparison, metrics, own = oracle["compare_router_loss"](family, model)
    assert model.config.router_aux_loss_coef == 0.25 and own.aux_loss > 0.1  # the router's loss weighs in
    assert comparison.matches, comparison.line()
    torch.testing.assert_close(metrics, own.aux_loss.reshape(1), rtol=1e-5, atol=0)


def test_a_dense_model_or_one_not_asking_for_its_router_loss_keeps_the_plain_objective():
    sft = oracle["SFT"]
    with oracle["quiet"]():
        moe = oracle["tiny_config"]("mixtral")  # router_aux_loss_coef set, output_router_logits off by default
        dense = oracle["tiny_config"]("qwen2")
    assert objectives.loss_for(sft, moe) is objectives.SFT
    assert objectives.loss_for(sft, dense) is objectives.SFT
    assert objectives.loss_for(sft) is objectives.SFT


def test_the_logit_table_names_only_known_operations_and_the_oracle_moves_every_attribute_it_reads():
    table = families.table()
    used = set(table["logits"].values()) | {op for ops in table["logits_by_family"].values() for op in ops.values()}
    assert used - {None} <= set(loss.LOGIT_OPS)
    assert all(oracle["LOGIT_WORDS"].search(name) or name == oracle["PADDED_VOCAB"] for name in table["logits"])


@pytest.mark.parametrize("family", ["mamba", "bert", "gemma3n_text"])
def test_a_refused_family_is_one_line_naming_it_and_why_with_exit_code_2(family):
    with pytest.raises(UsageError) as caught:
        families.check_loadable({"model_type": family})
    line = caught.value.one_line()
    assert line.startswith(f"model: trainlift cannot fine-tune {family!r} models: {families.refused()[family]}")
    assert "\n" not in line and caught.value.exit_code == 2


def test_the_check_imports_neither_torch_nor_transformers():
    code = ("import sys\nfrom trainlift.train.model import families\n"
            "try:\n    families.check_loadable({'model_type': 'rwkv'})\n"
            "except Exception as e:\n    print(type(e).__name__)\n"
            "families.check_loadable({'model_type': 'llama'})\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:2] == ["UsageError", "[]"]


def test_every_refused_family_is_a_causal_lm_of_this_transformers():
    """A name no longer in transformers' list would be a stale entry (the oracle test checks the rest both ways)."""
    assert set(families.refused()) <= families.causal_lm_types()


def families_section() -> str:
    text = (ROOT / "docs" / "training.md").read_text()
    return text.split("## Model families", 1)[1].split("\n## ", 1)[0]


def test_the_docs_list_every_refused_family_with_its_reason_and_every_other_as_matched():
    section = families_section()
    refused = {name: reason for name, reason in re.findall(r"^\| `([^`]+)` \| (.+?) \|$", section, re.MULTILINE)}
    matched = re.search(r"^Matched \(\d+\): (.+?)\.$", section, re.MULTILINE | re.DOTALL).group(1)
    assert refused == families.refused()
    assert set(re.findall(r"`([^`]+)`", matched)) == families.causal_lm_types() - set(refused)


def test_training_a_refused_family_stops_before_ray_with_one_line_and_exit_code_2(tmp_path, monkeypatch, capsys):
    from trainlift.cli import main
    from trainlift.train import launch

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started for a refused family")

    monkeypatch.setattr(launch, "ensure_ray", no_ray)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "mamba", "vocab_size": 282}')
    job = tmp_path / "job.yaml"
    job.write_text(f"model: {{path: {model}, tokenizer: {ROOT / 'examples' / 'tiny' / 'tokenizer'}}}\n"
                   f"data: {{train: {ROOT / 'examples' / 'data' / 'tasks-train.jsonl'}, format: messages}}\n"
                   f"run: {{name: refused, storage: {tmp_path / 'runs'}}}\n")
    monkeypatch.setattr(sys, "argv", ["trainlift", "train", str(job)])
    with pytest.raises(SystemExit) as exited:
        main()
    error = capsys.readouterr().err
    assert exited.value.code == 2 and error.count("\n") == 1
    assert f"cannot fine-tune 'mamba' models: {families.refused()['mamba']}" in error
