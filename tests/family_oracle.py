"""trainlift's loss against each model's own, for any causal LM type of transformers: a tiny random model (the
config class's defaults, shrunk), several examples packed into a micro-batch of two rows as trainlift collates
them, trainlift's chunked loss with a few tokens a chunk, and the model's own `model(input_ids, labels=...)` run
on each example alone (its mean loss times its trained tokens, summed). Loaded with runpy by the tests that use it.

The shrinking is generic: every size-like attribute of the defaults (and of their sub-configs) is capped, per-layer
lists and maps are cut to the fewest layers that keep every kind of layer, dropout and router jitter are off (and
the random state is reset before each forward), and every attribute named like a logit post-processing
(`LOGIT_WORDS`, which covers families.yaml's `logits`) gets a value far from neutral, so that a loss missing it
cannot match. `SPECIAL` holds what a few families need besides. Attention is the model's default kernel (sdpa where
the family supports it, else eager), in training mode, fp32."""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from trainlift.train.data import examples as data
from trainlift.train.model import families, objectives
from trainlift.train.model.loss import token_loss_sum

LAYERS = 2
LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "decoder_layers")
CAPS = {  # attribute -> the largest value a tiny model keeps
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embedding_size", "input_embedding_size",
                     "output_embedding_size", "lru_width", "word_embed_proj_dim", "adapter_in_dim",
                     "adapter_input_size", "adapter_out_dim", "emb_dim"), 64),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
                     "linear_num_heads", "linear_num_key_heads", "linear_num_value_heads", "mamba_n_heads",
                     "mamba_num_heads", "index_n_heads", "swa_num_attention_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "swa_num_key_value_heads", "n_groups"), 2),
    **dict.fromkeys(("head_dim", "v_head_dim", "qk_nope_head_dim", "qk_rope_head_dim", "linear_head_dim",
                     "linear_key_head_dim", "linear_value_head_dim", "mamba_d_head", "mamba_head_dim",
                     "index_head_dim", "kv_channels", "attention_head_dim", "swa_head_dim", "attention_head_size",
                     "hidden_size_per_layer_input", "laurel_rank", "d_head"), 16),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank", "o_lora_rank", "rotary_dim", "mamba_d_state",
                     "ssm_state_size", "state_size", "mamba_chunk_size", "chunk_size", "time_step_rank",
                     "mamba_dt_rank", "index_topk"), 16),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "decoder_ffn_dim", "n_inner", "ffn_hidden_size",
                     "moe_intermediate_size", "shared_expert_intermediate_size", "shared_intermediate_size",
                     "moe_shared_expert_intermediate_size", "dense_intermediate_size",
                     "first_dense_intermediate_size", "expert_ffn_hidden_size", "mlp_only_intermediate_size",
                     "intermediate_size_mlp", "shared_experts_intermediate_size", "mamba_d_ssm",
                     "feed_forward_size", "d_inner"), 64),
    **dict.fromkeys(("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_k", "moe_topk", "num_experts_per_token"), 2),
    **dict.fromkeys(("n_group", "topk_group", "num_expert_group"), 1),
    **dict.fromkeys(("vocab_size", "vocab_size_per_layer_input", "encoder_hash_byte_group_vocab"), 128),
}
LOGIT_WORDS = re.compile(r"logit|lm_head|multiplier|soft_?cap")
PADDED_VOCAB = "unpadded_vocab_size"  # set below the vocabulary, so that the padded rows are there to drop
QWEN4_INDEXER = {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                 "indexer_compress_ratio": 2, "ngram_vocab_size_base": 256, "make_ngram_vocab_size_divisible_by": 8,
                 "split_ngram_parts": 4, "ple_embed_dim": 32, "hc_lowrank": 16, "heads_per_ngram": 2}
SPECIAL: dict[str, dict] = {  # model type -> config fields a family needs besides the shrinking
    # Defaults that leave a size unset (real checkpoints set it):
    **dict.fromkeys(("hunyuan_v1_dense", "hunyuan_v1_moe", "ministral"), {"head_dim": 16}),
    "nemotron": {"num_key_value_heads": 2},
    "deepseek_v2": {"num_experts_per_tok": 2},
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    "lfm2_moe": {"layer_types": ["full_attention", "conv"], "num_dense_layers": 1},
    "dbrx": {"attn_config": {"kv_n_heads": 1, "rope_theta": 10000.0, "clip_qkv": 8.0}},
    "cohere_compass_text": {"rope_parameters": {kind: {"rope_type": "default", "rope_theta": 10000.0}
                                                for kind in ("full_attention", "sliding_attention")}},
    "qwen4_exp_text": QWEN4_INDEXER,
    "qwen4_exp": {"text_config": QWEN4_INDEXER},
    # Sizes tied to each other, where the caps break the tie:
    **dict.fromkeys(("bamba", "granitemoehybrid"), {"mamba_d_head": 32}),
    "falcon_h1": {"mamba_d_head": 16},
    "mamba2": {"head_dim": 32},
    "dots3_note_text": {"head_dim": 32},
    "dots3_note": {"text_config": {"head_dim": 32}},
    "kolibri1_1": {"index_num_heads": 2},
    "gemma3n_text": {"num_kv_shared_layers": 2},
    "dory": {"num_hidden_layers": 4, "n_input_layers": 1, "n_recurrent_layers": 2, "n_output_layers": 1,
             "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]},
    # Layer kinds real checkpoints use that the defaults leave out:
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    "minimax_m3_vl_text": {"layer_types": ["full_attention", "minimax_m3_sparse"]},
    "zamba": {"num_hidden_layers": 4, "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"]},
}
ROWS = [[6, 5, 7], [9, 8]]  # example lengths of the micro-batch's two packed rows
SEQ_LEN = 18
PROMPT = 2  # each example's first tokens are a prompt, not trained
CHUNK_TOKENS = 5
LOSS_RTOL = 1e-5  # |trainlift - own| / |own|, of the summed loss in fp32: only the order of reductions differs
GRAD_RTOL = 1e-4  # max |difference| over every parameter's gradient / max |own gradient|


def layer_count(defaults: dict) -> int | None:
    return next((defaults[k] for k in LAYER_COUNTS if isinstance(defaults.get(k), int)), None)


def kept_layers(defaults: dict, layers: int | None) -> int:
    """The fewest leading layers in which every per-layer list of a few kinds (one entry a layer: attention or MLP
    kinds) shows each of its kinds."""
    keep = LAYERS
    for value in defaults.values():
        if isinstance(value, list) and layers and len(value) == layers and len(kinds := [str(v) for v in value]) and \
                len(set(kinds)) <= 4:
            keep = max(keep, max(kinds.index(v) for v in set(kinds)) + 1)
    return keep


def far_from_neutral(key: str, value) -> float | None:
    """A logit post-processing value that changes the loss by far more than any tolerance."""
    if "soft" in key and "cap" in key:
        return 0.5 if value is None or "attn" not in key else None
    if isinstance(value, float) and not isinstance(value, bool):
        return 2.5 if value == 1.0 else value
    return None


def shrink_value(value):
    return {**value, **shrink(value)} if isinstance(value, dict) else value


def shrink(defaults: dict) -> dict:
    """Fields for `AutoConfig.for_model` that make the defaults `defaults` tiny."""
    layers = layer_count(defaults)
    keep = kept_layers(defaults, layers)
    small = {}
    for key, value in defaults.items():
        if isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
            small[key] = {k: shrink_value(v) for k, v in value.items() if int(k) < keep}
        elif isinstance(value, dict):  # a sub-config, or one per kind of layer
            small[key] = shrink_value(value)
        elif isinstance(value, list) and layers and len(value) == layers:
            small[key] = [min(v, CAPS[key]) if key in CAPS and isinstance(v, int) else v for v in value[:keep]]
        elif key in LAYER_COUNTS and isinstance(value, int):
            small[key] = min(value, keep)
        elif key in CAPS and isinstance(value, int) and not isinstance(value, bool):
            small[key] = min(value, CAPS[key])
        elif "dropout" in key or "jitter" in key or key.endswith("_pdrop"):  # train-time noise
            small[key] = 0.0 if isinstance(value, float) else value
        elif LOGIT_WORDS.search(key):
            if (changed := far_from_neutral(key, value)) is not None:
                small[key] = changed
    heads, kv_heads = defaults.get("num_attention_heads"), defaults.get("num_key_value_heads")
    if kv_heads is not None and kv_heads == heads:  # no grouped queries (MLA's latent keys): keep it so
        small["num_key_value_heads"] = small["num_attention_heads"]
    vocab = small.get("vocab_size", defaults.get("vocab_size"))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(defaults.get(key), int) and vocab and defaults[key] >= vocab:
            small[key] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}[key]
    if PADDED_VOCAB in defaults and vocab:
        small[PADDED_VOCAB] = vocab - 8
    return small


def merged(fields: dict, special: dict) -> dict:
    """`fields` with `special`'s, sub-configs merged key by key."""
    out = dict(fields)
    for key, value in special.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def tiny_config(model_type: str, **fields):
    """The tiny config of `model_type`, with `fields` besides."""
    from transformers import AutoConfig

    special = merged(SPECIAL.get(model_type, {}), fields)
    try:
        defaults = AutoConfig.for_model(model_type).to_dict()
    except ValueError:  # defaults the config class itself refuses
        defaults = AutoConfig.for_model(model_type, **special).to_dict()
    return AutoConfig.for_model(model_type, **merged(shrink(defaults), special))


@contextlib.contextmanager
def quiet():
    """No warnings from transformers about the odd tiny configs, and one thread: tiny matmuls only wait on more."""
    threads = torch.get_num_threads()
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            logging.disable(logging.NOTSET)
            torch.set_num_threads(threads)


def tiny_model(model_type: str, seed: int = 0, **fields):
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.train()


def examples(vocab: int, seed: int = 0) -> list[data.Example]:
    """Random examples of `ROWS`' lengths; tokens stay below `vocab - 8` (a padded vocabulary's real part)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for n in (n for row in ROWS for n in row):
        ids = torch.randint(3, vocab - 8, (n,), generator=generator).tolist()
        out.append(data.Example(ids, [data.IGNORE] * PROMPT + ids[PROMPT:]))
    return out


def vocab_of(model) -> int:
    return model.config.get_text_config().vocab_size


def trainlift_loss(model, batch: dict, chunk_tokens: int = CHUNK_TOKENS) -> torch.Tensor:
    head = model.get_output_embeddings()
    rows = head.weight.size(0) if head is not None else vocab_of(model)
    return token_loss_sum(model, batch, chunk_elements=chunk_tokens * rows)


def own_loss(model, example: data.Example) -> torch.Tensor:
    """The model's own loss of one example alone, summed over its trained tokens."""
    ids, labels = torch.tensor([example.input_ids]), torch.tensor([example.labels])
    torch.manual_seed(0)
    loss = model(input_ids=ids, labels=labels, use_cache=False).loss
    return loss * (labels[:, 1:] != data.IGNORE).sum()


@dataclass(frozen=True)
class Comparison:
    family: str
    loss: float  # |trainlift - own| / |own|
    grad: float  # max |difference| / max |own gradient|, over every trainable parameter
    error: str = ""

    @property
    def matches(self) -> bool:
        return not self.error and self.loss <= LOSS_RTOL and self.grad <= GRAD_RTOL

    def line(self) -> str:
        if self.error:
            return f"{self.family}: {self.error}"
        return f"{self.family}: loss {self.loss:.2e}, gradients {self.grad:.2e}"


def gradients(loss: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]


def compare_model(family: str, model, chunk_tokens: int = CHUNK_TOKENS) -> Comparison:
    """trainlift's summed loss of the packed micro-batch, and its gradients, against the model's own on each example
    alone."""
    exs = examples(vocab_of(model))
    packed = data.pack(exs, seq_len=SEQ_LEN, pad_id=0)
    assert [len(r) for r in packed.examples_per_row] == [len(r) for r in ROWS]
    params = [p for p in model.parameters() if p.requires_grad]
    torch.manual_seed(0)
    ours = trainlift_loss(model, data.collate(packed.rows), chunk_tokens)
    return compared(family, ours, sum(own_loss(model, ex) for ex in exs), params)


def compared(family: str, ours: torch.Tensor, own: torch.Tensor, params: list[torch.Tensor]) -> Comparison:
    our_grads, own_grads = gradients(ours, params), gradients(own, params)
    scale = max(g.abs().max().item() for g in own_grads)
    worst = max((a - b).abs().max().item() for a, b in zip(our_grads, own_grads))
    return Comparison(family, abs(ours.item() - own.item()) / abs(own.item()), worst / max(scale, 1e-30))


SFT = SimpleNamespace(train=SimpleNamespace(objective="sft"))
ROUTER_COEFFICIENT = 0.25


def router_fields(model_type: str) -> dict | None:
    """Config fields that ask a mixture of experts for its router's loss, with every coefficient families.yaml
    names that its config has set to `ROUTER_COEFFICIENT`; None for a model without the switch."""
    config = tiny_config(model_type)
    text = config.get_text_config()
    if not hasattr(text, "output_router_logits"):
        return None
    fields: dict = {"output_router_logits": True}
    for dotted in families.table()["aux_loss_coefficients"]:
        *parents, name = dotted.split(".")
        owner = functools.reduce(lambda c, n: getattr(c, n, None), parents, text)
        if getattr(owner, name, None) is not None:
            fields = merged(fields, functools.reduce(lambda inner, n: {n: inner}, reversed(parents),
                                                     {name: ROUTER_COEFFICIENT}))
    return fields if text is config else {"text_config": fields}


def router_batch(model) -> dict:
    """Two rows of one 9-token example each, no padding (the model's own run would attend from a padding token)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab_of(model) - 8, (2, 9), generator=generator).tolist()
    return data.collate(data.pack([data.Example(row, [data.IGNORE] * PROMPT + row[PROMPT:]) for row in ids], 9,
                                  0).rows)


def compare_router_loss(family: str, model) -> tuple[Comparison, torch.Tensor, Any]:
    """trainlift's SFT objective (`loss_for(spec, model.config)`) on `router_batch` over its trained tokens, against
    the model's own `loss` (its router's loss included as the config asks); also the objective's metric sums and
    the model's own output."""
    batch = router_batch(model)
    objective = objectives.loss_for(SFT, model.config)
    torch.manual_seed(0)
    ours, metrics = objective.loss(model, batch)
    torch.manual_seed(0)
    own = model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False)
    params = [p for p in model.parameters() if p.requires_grad]
    tokens = batch["trainable_tokens"]
    return compared(family, ours / tokens, own.loss, params), metrics / tokens, own


def compare(family: str) -> Comparison:
    """`compare_model` on a tiny `family` model; an exception (the tiny model cannot be built, or trainlift's loss
    or the model's own cannot run) is a mismatch that names it."""
    with quiet():
        try:
            return compare_model(family, tiny_model(family))
        except Exception as exc:  # noqa: BLE001 - every failure is an outcome here
            first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
            return Comparison(family, float("nan"), float("nan"), f"{type(exc).__name__}: {first}")
