"""Next-token cross-entropy without the `[batch, seq, vocab]` fp32 logits.

The LM head and the loss run on a few hundred tokens at a time, under activation checkpointing, so
forward and backward each hold one chunk's logits (about `CHUNK_ELEMENTS` floats) instead of the
whole micro-batch's: at a 151,936-token vocabulary a 2,048-token row is 1.2 GB of fp32 logits, and
the plain loss keeps two such tensors alive for backward.

The chunks run inside the model's forward (a forward hook on the decoder, whose output is the final,
normalised hidden state), because FSDP only gathers the LM head's weight during the root forward.
The model is asked to compute no logits of its own (`logits_to_keep` with no positions).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trainlift.train.data.examples import IGNORE

CHUNK_ELEMENTS = 2**25  # logits per chunk on the CPU: 128 MiB in fp32
GPU_CHUNK_TOKENS = 1024  # tokens per chunk on a GPU: matmuls of whole tiles (0.6 GB of fp32 logits at a 152k vocabulary)


def plain_token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of `logits[:, t]` predicting `labels[:, t + 1]` over trainable tokens."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), labels[:, 1:].reshape(-1),
                           ignore_index=IGNORE, reduction="sum")


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")


def chunked_token_loss_sum(hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor,
                           chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """The same sum as `plain_token_loss_sum(head(hidden), labels)`, one chunk of tokens at a time. Every position
    goes through the head, the ignored ones too (cross_entropy's ignore_index drops them): selecting the trained
    ones would read the labels back from the device and give the chunks data-dependent shapes."""
    hidden = hidden[:, :-1].reshape(-1, hidden.size(-1))
    targets = labels[:, 1:].reshape(-1)
    chunk = GPU_CHUNK_TOKENS if hidden.is_cuda else max(1, chunk_elements // head.weight.size(0))
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, targets.numel(), chunk):
        part = slice(start, start + chunk)
        total = total + checkpoint(_chunk_loss, hidden[part], head.weight, head.bias, targets[part],
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
    from its restarting position ids (the layout of `DataCollatorWithFlattening`)."""
    ids, positions, labels = batch["input_ids"], batch["position_ids"], batch["labels"]
    if "flash" in model.config._attn_implementation and ids.size(0) > 1:
        ids, positions, labels = (t.reshape(1, -1) for t in (ids, positions, labels))
    pad = -ids.size(1) % FLEX_BLOCK
    if pad and ids.device.type == "cpu" and model.config._attn_implementation == "flex_attention":
        ids = F.pad(ids, (0, pad))
        positions = torch.cat([positions, torch.arange(pad).expand(len(positions), pad)], dim=1)
        labels = F.pad(labels, (0, pad), value=IGNORE)
    return {"input_ids": ids, "position_ids": positions, "use_cache": False}, labels


def token_loss_sum(model, batch: dict[str, torch.Tensor], chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """Summed next-token cross-entropy over trainable (label != -100) tokens of a causal LM, packed examples
    kept apart (`model_inputs`). Models without a separate decoder and linear head get the plain loss."""
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    inputs, labels = model_inputs(model, batch)
    if decoder is model or not isinstance(head, torch.nn.Linear):
        return plain_token_loss_sum(model(**inputs).logits, labels)
    found: list[torch.Tensor] = []

    def loss_from_hidden(module, args, output):
        found.append(chunked_token_loss_sum(output.last_hidden_state, head, labels, chunk_elements))

    handle = decoder.register_forward_hook(loss_from_hidden)
    try:
        model(**inputs, logits_to_keep=torch.zeros(0, dtype=torch.long, device=labels.device))
    finally:
        handle.remove()
    return found[0]
