"""A causal LM's size from its Hugging Face config alone: what memory and FLOPs depend on, no weights read.

Counts follow the decoder every supported family shares (attention, a gated or plain MLP or a mixture of
experts, two norms per layer, embeddings and an LM head); biases and norm weights are left out (under 0.1%).
What a config cannot say, whether the MLP is gated, is catalog data (estimate.yaml: `plain_mlp_model_types`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainlift.estimate.assumptions import assumptions
from trainlift.errors import SpecError

LORA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    gated_mlp: bool = True
    experts: int = 0
    experts_per_token: int = 0
    expert_ffn: int = 0
    shared_expert_ffn: int = 0
    moe_layers: int = 0

    @property
    def attention_params(self) -> int:
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * q_out * 2 + self.hidden * kv_out * 2

    def _mlp(self, ffn: int) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden * ffn

    @property
    def moe_layer_mlp_params(self) -> int:
        return self.experts * self._mlp(self.expert_ffn) + self.hidden * self.experts + self._mlp(self.shared_expert_ffn)

    @property
    def layer_params(self) -> int:
        """Parameters of the largest decoder layer (an MoE one where there are any): one FSDP unit."""
        mlp = self.moe_layer_mlp_params if self.moe_layers else self._mlp(self.ffn)
        return self.attention_params + mlp

    @property
    def decoder_params(self) -> int:
        dense = self.layers - self.moe_layers
        return (self.layers * self.attention_params + dense * self._mlp(self.ffn)
                + self.moe_layers * self.moe_layer_mlp_params)

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        """The LM head's own parameters: none when it shares the embedding's."""
        return 0 if self.tied else self.vocab * self.hidden

    @property
    def params(self) -> int:
        return self.decoder_params + self.embedding_params + self.head_params

    @property
    def active_decoder_params(self) -> int:
        """Decoder parameters one token goes through: its top-k experts, not all of them."""
        if not self.moe_layers:
            return self.decoder_params
        routed_off = (self.experts - self.experts_per_token) * self._mlp(self.expert_ffn)
        return self.decoder_params - self.moe_layers * routed_off

    def lora_params(self, r: int, targets: list[str] | str) -> int:
        """Adapter parameters, r·(in + out) per adapted linear of every layer. all-linear (and a name the usual
        decoder does not have) counts the seven linears of a Llama-style layer; MoE experts are fused, not Linear."""
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        ffn = self.ffn if not self.moe_layers else self.shared_expert_ffn
        sizes = {"q_proj": (self.hidden, q_out), "k_proj": (self.hidden, kv_out), "v_proj": (self.hidden, kv_out),
                 "o_proj": (q_out, self.hidden), "gate_proj": (self.hidden, ffn), "up_proj": (self.hidden, ffn),
                 "down_proj": (ffn, self.hidden)}
        names = LORA_LINEARS if targets == "all-linear" or not set(targets) & set(sizes) else targets
        return self.layers * sum(r * sum(sizes[name]) for name in names if name in sizes)


def _moe_layers(config: Any, layers: int) -> int:
    step = getattr(config, "decoder_sparse_step", None) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    first_dense = getattr(config, "first_k_dense_replace", None) or 0
    return sum(1 for i in range(layers) if i >= first_dense and i not in dense and (i + 1) % step == 0)


def shape_of(config: Any) -> ModelShape:
    """The shape of a transformers `PretrainedConfig` (its text part for a multimodal model)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text, "model_type", "") or ""
    if getattr(text, "kv_lora_rank", None):
        raise SpecError(f"estimate cannot size {model_type}'s multi-head latent attention",
                        hint="estimate supports multi-head and grouped-query attention models")
    try:
        hidden, layers, heads = int(text.hidden_size), int(text.num_hidden_layers), int(text.num_attention_heads)
        vocab = int(text.vocab_size)
    except (AttributeError, TypeError):
        raise SpecError(f"the {model_type or 'model'} config has no hidden_size, num_hidden_layers, "
                        "num_attention_heads or vocab_size", hint="give model.config or a model with a "
                        "transformers config.json") from None
    experts = int(getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None)
                  or getattr(text, "n_routed_experts", None) or 0)
    ffn = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    shared = int(getattr(text, "shared_expert_intermediate_size", None)
                 or (getattr(text, "n_shared_experts", None) or 0) * (getattr(text, "moe_intermediate_size", None) or 0))
    return ModelShape(
        model_type=model_type, hidden=hidden, layers=layers, heads=heads,
        kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or hidden // heads), ffn=ffn, vocab=vocab,
        tied=bool(getattr(text, "tie_word_embeddings", False)),
        gated_mlp=model_type not in assumptions()["plain_mlp_model_types"],
        experts=experts, experts_per_token=int(getattr(text, "num_experts_per_tok", None) or 0) if experts else 0,
        expert_ffn=int(getattr(text, "moe_intermediate_size", None) or ffn) if experts else 0,
        shared_expert_ffn=shared if experts else 0,
        moe_layers=_moe_layers(text, layers) if experts else 0,
    )
