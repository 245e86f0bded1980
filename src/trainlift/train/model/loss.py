"""Next-token cross-entropy without the `[batch, seq, vocab]` fp32 logits.

The LM head and the loss run on a few hundred tokens at a time, under activation checkpointing, so
forward and backward each hold one chunk's logits (about `CHUNK_ELEMENTS` floats) instead of the
whole micro-batch's: at a 151,936-token vocabulary a 2,048-token row is 1.2 GB of fp32 logits, and
the plain loss keeps two such tensors alive for backward.

The chunks run inside the model's forward (a forward hook on the decoder, whose output is the final,
normalised hidden state), because FSDP only gathers the LM head's weight during the root forward.
The model is asked to compute no logits of its own (`logits_to_keep` with no positions), so what its
causal LM forward does after the head (Gemma2's soft-cap, Granite's and Cohere's scaling) is done here,
from its config (`logit_transform`, the table in families.yaml).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from trainlift.train.data.examples import IGNORE
from trainlift.train.model import families

CHUNK_ELEMENTS = 2**25  # logits per chunk on the CPU: 128 MiB in fp32
GPU_CHUNK_TOKENS = 1024  # tokens per chunk on a GPU: matmuls of whole tiles (0.6 GB of fp32 logits at a 152k vocabulary)

LOGIT_OPS: dict[str, Callable[[torch.Tensor, Any], torch.Tensor]] = {
    "multiply": lambda logits, value: logits * value,
    "divide": lambda logits, value: logits / value,
    "softcap": lambda logits, value: torch.tanh(logits / value) * value,
    "first": lambda logits, value: logits[..., :value],
}
Transform = Callable[[torch.Tensor], torch.Tensor]


def unchanged(logits: torch.Tensor) -> torch.Tensor:
    return logits


def _apply(logits: torch.Tensor, steps: tuple[tuple[str, Any], ...]) -> torch.Tensor:
    for op, value in steps:
        logits = LOGIT_OPS[op](logits, value)
    return logits


def logit_transform(config) -> Transform:
    """What the causal LM of `config` does to its LM head's output before its loss (families.yaml `logits`), as a
    function of the head's fp32 output; the identity for most families."""
    text = config.get_text_config()
    steps = families.logit_steps(config.model_type, lambda name: getattr(text, name, None))
    return functools.partial(_apply, steps=tuple(steps))


def plain_token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of `logits[:, t]` predicting `labels[:, t + 1]` over trainable tokens."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), labels[:, 1:].reshape(-1),
                           ignore_index=IGNORE, reduction="sum")


def chunk_logits(hidden: torch.Tensor, head: torch.nn.Module, weights: dict[str, torch.Tensor],
                 transform: Transform) -> torch.Tensor:
    """fp32 logits of a chunk of hidden states: `head` run on its `weights` (the tensors of its forward, so a
    checkpointed chunk recomputes with them, not with whatever FSDP holds by then), then `transform`."""
    return transform(functional_call(head, weights, (hidden,)).float())


def head_weights(head: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(head.named_parameters())


def _chunk_loss(hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module,
                weights: dict[str, torch.Tensor], transform: Transform) -> torch.Tensor:
    return F.cross_entropy(chunk_logits(hidden, head, weights, transform), targets, ignore_index=IGNORE,
                           reduction="sum")


def chunk_tokens(hidden: torch.Tensor, head: torch.nn.Module, chunk_elements: int) -> int:
    return GPU_CHUNK_TOKENS if hidden.is_cuda else max(1, chunk_elements // head.weight.size(0))


def chunked_token_loss_sum(hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor,
                           chunk_elements: int = CHUNK_ELEMENTS, transform: Transform = unchanged) -> torch.Tensor:
    """The same sum as `plain_token_loss_sum(transform(head(hidden)), labels)`, one chunk of tokens at a time. Every
    position goes through the head, the ignored ones too (cross_entropy's ignore_index drops them): selecting the
    trained ones would read the labels back from the device and give the chunks data-dependent shapes."""
    hidden = hidden[:, :-1].reshape(-1, hidden.size(-1))
    targets = labels[:, 1:].reshape(-1)
    chunk, weights = chunk_tokens(hidden, head, chunk_elements), head_weights(head)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, targets.numel(), chunk):
        part = slice(start, start + chunk)
        total = total + checkpoint(_chunk_loss, hidden[part], targets[part], head, weights, transform,
                                   use_reentrant=False)
    return total


FLEX_BLOCK = 128  # torch's default flex-attention block, the one transformers' block masks use


def model_inputs(model, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor | bool], torch.Tensor]:
    """The forward's keyword arguments for `batch`, and the labels that go with them.

    No KV cache and no attention mask: without them, transformers (5.x, `masking_utils.find_packed_sequence_indices`)
    reads restarting position ids as packed examples and masks attention between them, in every kernel; an
    attention mask turns that off. flex_attention on a CPU: rows are padded to a multiple of `FLEX_BLOCK` with one
    more example of ignored labels, because torch 2.13's CPU flex kernel (Inductor's fp32 micro-GEMM for q·kᵀ,
    `cpp_micro_gemm.py`, its N-tail path) reads keys past the row and writes scores past the tile when a tile's
    length is 8 mod 16 (AVX2): wrong and often NaN logits, packed or not. GPUs run Triton's kernel instead.

    flash-attn kernels see packed examples only in a batch of one row (transformers' `_is_packed_sequence`); with
    more rows they attend across the examples of each row. So the rows of a micro-batch go in as one row: every row
    starts an example whose first label is ignored, so no loss term crosses rows, and each example's cu_seqlens come
    from its restarting position ids (the layout of `DataCollatorWithFlattening`). They are computed here, once per
    micro-batch (`flash_varlen_kwargs`): from position ids alone transformers recomputes them in every layer, a
    device-to-host sync each time and a graph break in a compiled block."""
    ids, labels = laid_out(model, batch["input_ids"], 0), laid_out(model, batch["labels"], IGNORE)
    positions = batch["position_ids"]
    if "flash" in model.config._attn_implementation:
        positions = positions.reshape(1, -1)
        return {"input_ids": ids, "position_ids": positions, "use_cache": False,
                **flash_varlen_kwargs(positions)}, labels
    if (pad := ids.size(1) - positions.size(1)) > 0:
        positions = torch.cat([positions, torch.arange(pad).expand(len(positions), pad)], dim=1)
    return {"input_ids": ids, "position_ids": positions, "use_cache": False}, labels


def laid_out(model, tokens: torch.Tensor, fill: int) -> torch.Tensor:
    """A [rows, seq] per-token tensor as `model_inputs` lays out the micro-batch: one row for flash-attn, each row
    padded with `fill` to a multiple of `FLEX_BLOCK` for flex_attention on a CPU."""
    if "flash" in model.config._attn_implementation:
        return tokens.reshape(1, -1)
    pad = -tokens.size(1) % FLEX_BLOCK
    if pad and tokens.device.type == "cpu" and model.config._attn_implementation == "flex_attention":
        return F.pad(tokens, (0, pad), value=fill)
    return tokens


def flash_varlen_kwargs(positions: torch.Tensor) -> dict[str, torch.Tensor | int]:
    """flash-attn's variable-length arguments for one row of packed examples, under the names transformers' flash
    path takes them (`cu_seq_lens_q/k`: int32 offsets of each example, from 0 to the row's length; `max_length_q/k`:
    the longest example, a Python int). An example starts where a position does not follow the one before it. One
    read back from the device (the starts), for the whole micro-batch."""
    flat = positions.reshape(-1)
    restarts = torch.ones_like(flat, dtype=torch.bool)
    restarts[1:] = flat[1:] != flat[:-1] + 1
    offsets = torch.nonzero(restarts).reshape(-1).tolist() + [flat.numel()]
    cu_seq_lens = torch.tensor(offsets, dtype=torch.int32, device=flat.device)
    longest = max(b - a for a, b in zip(offsets, offsets[1:]))
    return {"cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens, "max_length_q": longest,
            "max_length_k": longest}


def chunked_head(model) -> bool:
    """Whether the model has a decoder apart from a linear LM head, so the head can run a chunk at a time."""
    return model.get_decoder() is not model and isinstance(model.get_output_embeddings(), torch.nn.Linear)


def head_forward(model, inputs: dict, on_hidden: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, Any]:
    """`on_hidden(final hidden state)`, run inside the model's forward (a hook on its decoder), and the model's
    output, which holds no logits (MoE: it holds the router's `aux_loss`)."""
    found: list[torch.Tensor] = []

    def from_decoder(module, args, output) -> None:
        found.append(on_hidden(output.last_hidden_state))

    handle = model.get_decoder().register_forward_hook(from_decoder)
    try:
        output = model(**inputs, logits_to_keep=torch.zeros(0, dtype=torch.long, device=inputs["input_ids"].device))
    finally:
        handle.remove()
    return found[0], output


def token_loss_and_aux(model, batch: dict[str, torch.Tensor],
                       chunk_elements: int = CHUNK_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_loss_sum`, and the router's load-balancing loss over the micro-batch where the model computes one
    (an MoE whose config sets `output_router_logits`), else None."""
    inputs, labels = model_inputs(model, batch)
    if not chunked_head(model):  # the model's own logits, already post-processed
        output = model(**inputs)
        return plain_token_loss_sum(output.logits, labels), getattr(output, "aux_loss", None)
    head, transform = model.get_output_embeddings(), logit_transform(model.config)
    loss, output = head_forward(model, inputs, lambda hidden: chunked_token_loss_sum(
        hidden, head, labels, chunk_elements, transform))
    return loss, getattr(output, "aux_loss", None)


def token_loss_sum(model, batch: dict[str, torch.Tensor], chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """Summed next-token cross-entropy over trainable (label != -100) tokens of a causal LM, packed examples
    kept apart (`model_inputs`). Models without a separate decoder and linear head get the plain loss."""
    return token_loss_and_aux(model, batch, chunk_elements)[0]
