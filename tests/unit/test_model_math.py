"""Model-side arithmetic: FLOPs per token (for MFU), the LR schedule, layer discovery."""

from types import SimpleNamespace

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
        model = AutoModelForCausalLM.from_config(QWEN25_15B)
    flops = step_flops(model)
    # By hand. A layer: q 1536·1536 + 1536 bias, k and v 1536·256 + 256 each, o 1536·1536, MLP 3·1536·8960, two
    # norms 2·1536: 46,797,824; 28 layers and the final norm: 1,310,340,608 non-embedding parameters. Embedding
    # 151,936·1536 = 233,373,696, tied, so the head's 6·V·d is counted too: base = 6·1,543,714,304.
    # Attention: 12·L·H·Q = 12·28·12·128 = 516,096 per attended position.
    assert (flops.base, flops.attention) == (9_262_285_824, 516_096)
    packed, whole = flops.per_token(attended_pairs(row) / 2048), flops.per_token(2048)
    assert whole == 9_262_285_824 + 516_096 * 2048 == 10_319_250_432  # FACTS.md: about 10.3 GFLOPs/token
    assert packed == 9_262_285_824 + 516_096 * 512 == 9_526_526_976
    assert flops_per_token(model, 2048) == whole and flops_per_token(model, 512) == packed


def test_decoder_layers_are_found_from_the_model_declaration():
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                                             num_attention_heads=2, num_key_value_heads=1, vocab_size=50))
    assert len(decoder_layers(model)) == 3


def test_lr_warms_up_then_decays_to_the_floor():
    """Linear warmup (step + 1) / (warmup + 1), then the published cosine to the floor:
    min_ratio + (1 - min_ratio) * 0.5 * (1 + cos(pi * progress)), progress = (step - warmup) / (total - warmup);
    the values worked by hand (cos(pi/16) = 0.98078528, cos(pi/4) = 0.70710678), not by the code under test."""
    f = lr_lambda(warmup=4, total=20, min_ratio=0.1)
    assert [f(step) for step in range(4)] == pytest.approx([0.2, 0.4, 0.6, 0.8], abs=1e-12)
    cosine = {4: 1.0, 5: 0.991353376, 8: 0.868198052, 12: 0.55, 16: 0.231801948, 19: 0.108646624, 20: 0.1,
              30: 0.1}  # past `total` it stays at the floor
    assert {step: f(step) for step in cosine} == pytest.approx(cosine, abs=1e-9)
    none = lr_lambda(warmup=0, total=10, min_ratio=0.0)  # no warmup: the first step at the peak, the last at 0
    assert [none(step) for step in (0, 5, 10)] == pytest.approx([1.0, 0.5, 0.0], abs=1e-12)
    flat = lr_lambda(warmup=3, total=3, min_ratio=0.2)  # no step left to decay over: warmup, then the peak
    assert [flat(step) for step in (2, 3)] == pytest.approx([0.75, 1.0], abs=1e-12)
    one = lr_lambda(warmup=2, total=3, min_ratio=0.0)  # one step to decay over: it lands on the floor
    assert [one(step) for step in (2, 3)] == pytest.approx([1.0, 0.0], abs=1e-12)


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


def test_recomputed_flops_by_hand():
    """A Llama of 4 layers, d 64, 4 heads of 16 (2 KV heads), MLP 128, vocabulary 1,000, untied. A layer: q and o
    64·64, k and v 64·32, MLP 3·64·128, two norms of 64: 36,992 parameters; the decoder, final norm included and
    embedding left out, 148,032; the whole model 276,032 (embedding and head 64,000 each). Model FLOPs: 6·212,032
    (all but the embedding) and 12·4·4·16 = 3,072 per attended position. A checkpointed block keeping its inputs
    runs its forward again: 2 per parameter a token goes through, 4·H·Q = 256 per attended position; the chunked
    loss runs the head's forward again, 2·64,000, whatever the checkpointing."""
    from transformers import AutoConfig

    from trainlift.train.model.build import BlockCheckpointing, step_flops, with_recompute

    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    fpt = step_flops(model)
    assert (fpt.base, fpt.attention) == (6 * 212_032, 3_072)
    head = 2 * 64_000
    expected = {  # (mode, every, keeps): (recomputed FLOPs per token, per attended position)
        ("none", 2, "inputs"): (head, 0),
        ("selective", 2, "inputs"): (2 * 148_032 * 2 / 4 + head, 2 * 256),  # blocks 2 and 4 of 4
        ("selective", 3, "inputs"): (2 * 148_032 * 1 / 4 + head, 256),  # block 3 alone
        ("full", 2, "inputs"): (2 * 148_032 + head, 4 * 256),
        ("full", 2, "matmuls"): (head, 0),  # the blocks' matmul outputs are kept: no FLOPs run again
    }
    for (mode, every, keeps), (base, attention) in expected.items():
        again = with_recompute(fpt, model, BlockCheckpointing(mode, every, keeps))
        assert (again.recompute_base, again.recompute_attention) == (base, attention), (mode, every, keeps)
        assert again.per_token(100) == 6 * 212_032 + 3_072 * 100
        assert again.hardware_per_token(100) == 6 * 212_032 + 3_072 * 100 + base + attention * 100


class BareCausalLM(torch.nn.Module):
    """A causal LM as trainlift sees one, with a config that declares neither head_dim nor tie_word_embeddings (as
    a few transformers families do) and no decoder apart from itself: a 10-token vocabulary, d 8, one block of one
    8x8 linear, 2 heads, an untied head of its own."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(num_attention_heads=2, hidden_size=8, num_hidden_layers=1)
        self.embed, self.block, self.head = (torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8),
                                             torch.nn.Linear(8, 10, bias=False))

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head

    def get_decoder(self):
        return self


def test_flops_of_a_model_that_declares_little():
    """Parameters: embedding 80, block 72, head 80. Untied unless the config says so: 6·(72 + 80) = 912; head_dim
    8 / 2 = 4, so 12·1·2·4 = 96 per attended position. Without a decoder apart from the head the loss is not
    chunked: no head forward again; full checkpointing reruns 2·(72 + 80) and 4·2·4 = 32 per position."""
    from trainlift.train.model.build import BlockCheckpointing, idle_expert_params, step_flops, with_recompute

    model = BareCausalLM()
    fpt = step_flops(model)
    assert (fpt.base, fpt.attention) == (912, 96) and idle_expert_params(model) == 0
    none = with_recompute(fpt, model, BlockCheckpointing("none"))
    full = with_recompute(fpt, model, BlockCheckpointing("full"))
    assert (none.recompute_base, none.recompute_attention) == (0, 0)
    assert (full.recompute_base, full.recompute_attention) == (2 * 152, 32)


def test_attention_flops_use_the_declared_head_dim():
    """A Llama whose heads are 24 wide though d / H is 16: 12·4·4·24 = 4,608 per attended position, and 4·4·4·24 =
    1,536 again under full checkpointing."""
    from transformers import AutoConfig

    from trainlift.train.model.build import BlockCheckpointing, step_flops, with_recompute

    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, head_dim=24)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    fpt = with_recompute(step_flops(model), model, BlockCheckpointing("full"))
    assert (fpt.attention, fpt.recompute_attention) == (4_608, 1_536)


def test_a_checkpointed_moe_block_reruns_the_experts_a_token_is_routed_to():
    """Mixtral, 2 layers, d 64, 4 heads of 16 (2 KV), 4 experts of 3·64·128 = 24,576, top 2. A layer: attention
    12,288, router 256, experts 98,304, norms 128: 110,976; the decoder (final norm, no embedding) 222,016, of
    which half the experts (98,304) idle: full checkpointing reruns 2·123,712, plus the head's 2·64,000."""
    from transformers import AutoConfig

    from trainlift.train.model.build import BlockCheckpointing, idle_expert_params, step_flops, with_recompute

    config = AutoConfig.for_model("mixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                  num_local_experts=4, num_experts_per_tok=2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert idle_expert_params(model) == 98_304
    fpt = with_recompute(step_flops(model), model, BlockCheckpointing("full"))
    assert fpt.recompute_base == 2 * 123_712 + 2 * 64_000


def routed(experts_config, parameters=(("layers.0.experts.w", 10), ("layers.0.attn.w", 7))):
    """A model of `experts_config` whose parameters are named (numel given), for idle_expert_params."""
    params = [(name, torch.empty(n, device="meta")) for name, n in parameters]
    return SimpleNamespace(config=experts_config, named_parameters=lambda: iter(params))


@pytest.mark.parametrize("name", ["num_local_experts", "num_experts", "n_routed_experts"])
def test_idle_experts_under_each_name_families_give_their_count(name):
    """Mixtral's num_local_experts, Qwen-MoE's num_experts, DeepSeek's n_routed_experts: 10 routed parameters, 4
    experts, top 1: 10·3 // 4 = 7 idle (whole parameters, rounded down)."""
    from trainlift.train.model.build import idle_expert_params

    assert idle_expert_params(routed(SimpleNamespace(**{name: 4}, num_experts_per_tok=1))) == 7
    assert idle_expert_params(routed(SimpleNamespace(**{name: 4}))) == 0  # no top-k: not a routed MoE


def test_idle_experts_of_a_multimodal_model_are_read_from_its_text_config():
    from trainlift.train.model.build import idle_expert_params

    text = SimpleNamespace(num_local_experts=4, num_experts_per_tok=1)
    composite = SimpleNamespace(get_text_config=lambda: text)
    assert idle_expert_params(routed(composite)) == 7
