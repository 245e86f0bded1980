"""Model-side arithmetic: FLOPs per token (for MFU), the LR schedule, layer discovery."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from trainlift.train.model.build import decoder_layers, flops_per_token
from trainlift.train.recipe import lr_lambda

QWEN25_15B = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)


def test_flops_per_token_matches_the_published_qwen25_figure():
    """FACTS.md: Qwen2.5-1.5B is about 10.3 GFLOPs/token at T = 2048 (PaLM appendix B formula)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(QWEN25_15B)
    assert flops_per_token(model, 2048) == pytest.approx(10.3e9, rel=0.01)


def test_packed_rows_count_attention_over_each_example_not_the_whole_row():
    """Four 512-token examples packed in a 2048-token row attend to 512 positions each, not 2048: charging the
    row length would overstate Qwen2.5-1.5B's FLOPs per token, and so MFU, by about 10%."""
    import numpy as np

    from trainlift.train.data.examples import attended_pairs
    from trainlift.train.model.build import step_flops

    row = np.array(list(range(512)) * 4)
    assert attended_pairs(row) == 4 * 512 ** 2 and attended_pairs(np.arange(2048)) == 2048 ** 2
    with torch.device("meta"):
        flops = step_flops(AutoModelForCausalLM.from_config(QWEN25_15B))
    packed, whole = flops.per_token(attended_pairs(row) / 2048), flops.per_token(2048)
    assert whole == flops_per_token_of(QWEN25_15B, 2048)
    assert 1.08 < whole / packed < 1.12


def flops_per_token_of(config, seq_len):
    with torch.device("meta"):
        return flops_per_token(AutoModelForCausalLM.from_config(config), seq_len)


def test_decoder_layers_are_found_from_the_model_declaration():
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                                             num_attention_heads=2, num_key_value_heads=1, vocab_size=50))
    assert len(decoder_layers(model)) == 3


def test_lr_warms_up_then_decays_to_the_floor():
    f = lr_lambda(warmup=4, total=20, min_ratio=0.1)
    assert f(0) < f(3) < 1.0
    assert f(4) == pytest.approx(1.0)
    assert f(12) < f(4)
    assert f(20) == pytest.approx(0.1)


def test_packed_examples_do_not_attend_to_each_other():
    """The loss of a packed row equals the sum of its examples' losses computed one by one."""
    from trainlift.train.data import examples as data
    from trainlift.train.model.loss import token_loss_sum

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=50))
    examples = [data.Example(ids, ids) for ids in ([3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14])]
    packed = data.pack(examples, seq_len=16, pad_id=0)
    assert len(packed.rows) == 1
    with torch.no_grad():
        together = token_loss_sum(model, data.collate(packed.rows))
        apart = sum(token_loss_sum(model, data.collate(data.pack([ex], 16, 0).rows)) for ex in examples)
    torch.testing.assert_close(together, apart, rtol=1e-5, atol=1e-5)


def test_padding_is_no_example_in_the_attention_count():
    """A 1,200-token example padded to a 2,048-token row attends over 1,200 positions; the padding's restarting
    positions once added 848² to the row's count (1,799 attended positions per real token instead of 1,200)."""
    from trainlift.train.data.examples import Example, collate, pack

    rows = pack([Example(list(range(1200)), list(range(1200)))], seq_len=2048, pad_id=0).rows
    batch = collate(rows)
    assert batch["num_tokens"] == 1200 and batch["attended_pairs"] == 1200 ** 2


def test_a_mixture_of_experts_counts_the_experts_a_token_is_routed_to():
    """Mixtral-style top-2 of 4 experts: the recipe's FLOPs count half the routed experts' weights, and agree
    with the estimate's count of the active parameters."""
    from transformers import AutoConfig

    from trainlift.estimate.memory import Workload
    from trainlift.estimate.shape import shape_of
    from trainlift.estimate.timing import model_flops_per_token
    from trainlift.train.model.build import idle_expert_params, step_flops

    config = AutoConfig.for_model("mixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                  num_local_experts=4, num_experts_per_tok=2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    routed = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    assert idle_expert_params(model) == routed // 2
    w = Workload(1, 128, 1, False, gpu=True, bf16=True, workers=1)
    assert step_flops(model).per_token(128) == pytest.approx(model_flops_per_token(shape_of(config), w), rel=0.01)


@pytest.mark.parametrize("mode, every, keeps", [("none", 2, "inputs"), ("selective", 2, "inputs"),
                                                 ("full", 2, "inputs"), ("full", 2, "matmuls")])
def test_hardware_flops_add_what_recomputation_runs_and_agree_with_the_estimate(mode, every, keeps):
    """HFU counts what the GPUs execute: the model's FLOPs (MFU's), the checkpointed blocks' forward again and the
    chunked loss's LM head again; the recipe's count and the estimate's agree."""
    from transformers import AutoConfig

    from trainlift.estimate.memory import Workload
    from trainlift.estimate.shape import shape_of
    from trainlift.estimate.timing import hardware_flops_per_token
    from trainlift.train.model.build import BlockCheckpointing, step_flops, with_recompute

    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    fpt = with_recompute(step_flops(model), model, BlockCheckpointing(mode, every, keeps))
    w = Workload(1, 128, 1, mode, gpu=True, bf16=True, workers=1, checkpoint_every=every, checkpoint_keeps=keeps)
    assert fpt.hardware_per_token(128) == pytest.approx(hardware_flops_per_token(shape_of(config), w), rel=0.01)
    assert fpt.hardware_per_token(128) - fpt.per_token(128) >= 2 * 1000 * 64  # the LM head's forward, always
