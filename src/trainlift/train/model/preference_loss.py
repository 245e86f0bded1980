"""The DPO loss on packed preference rows, and the reference log-probs it compares against.

One forward over a micro-batch gives every example's sequence log-prob: the sum of its trained (response) tokens'
log-probs. The LM head runs a chunk of tokens at a time inside the decoder's forward hook, as in loss.py, so no
`[batch, seq, vocab]` fp32 logits are held and FSDP's root forward gathers the head; its output is post-processed as
the model's own forward does (loss.py's `logit_transform`: Gemma2's soft-cap, Granite's and Cohere's scaling). Examples come in pairs,
chosen then rejected (preference.py packs them so), and each pair's loss is TRL's sigmoid DPO loss with label
smoothing (conservative DPO), plus, with `sft_weight`, the chosen response's per-token NLL (RPO):

    m = beta * ((pi_chosen - ref_chosen) - (pi_rejected - ref_rejected))
    loss = -logsigmoid(m) * (1 - label_smoothing) - logsigmoid(-m) * label_smoothing - sft_weight * pi_chosen / n

The reference log-probs (`ref_*`) are the model's as the run starts, scored once for every example of the train
and eval rows and kept in the run directory, `reference/<split>-<data cache key>.npy`, written under a temporary
name and moved into place, so that only a whole file is ever read.
"""

from __future__ import annotations

import io
import uuid
from typing import Iterable, Sequence

import numpy as np
import pyarrow.fs as pafs
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trainlift.config.job import DpoSection
from trainlift.train.data import preference
from trainlift.train.data.examples import IGNORE
from trainlift.train.model.loss import (CHUNK_ELEMENTS, Transform, chunk_logits, chunk_tokens, chunked_head,
                                        head_forward, head_weights, laid_out, logit_transform, model_inputs,
                                        unchanged)

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy")


def with_pairs(batch: dict, rows: Sequence[dict], reference: np.ndarray | None = None) -> dict:
    """`batch` (the collated `rows`) with what the DPO loss reads: each token's example (`example_ids`), each
    example's trained-token count, the example and pair counts, and the examples' reference log-probs."""
    owners, counts = preference.example_layout(rows)
    batch.update(example_ids=torch.from_numpy(owners), response_tokens=torch.from_numpy(counts),
                 examples=len(counts), pairs=len(counts) // 2)
    if reference is not None:
        batch["reference_logps"] = torch.from_numpy(np.asarray(reference, dtype=np.float64))
    return batch


def examples_of_rows(packed, indices: Sequence[int]) -> np.ndarray:
    """The global indices of the examples in rows `indices` of `packed`, in batch order."""
    return np.asarray([e for j in indices for e in packed.examples_per_row[j]], dtype=np.int64)


def example_count(packed) -> int:
    return int(packed.examples_per_row[-1][-1]) + 1 if len(packed.rows) else 0


def _example_sums(logits: torch.Tensor, targets: torch.Tensor, owners: torch.Tensor, slots: int) -> torch.Tensor:
    token_logps = -F.cross_entropy(logits.float(), targets, ignore_index=IGNORE, reduction="none")
    return token_logps.new_zeros(slots).index_add(0, owners, token_logps)


def _chunk_sums(hidden: torch.Tensor, targets: torch.Tensor, owners: torch.Tensor, slots: int, head: torch.nn.Module,
                weights: dict[str, torch.Tensor], transform: Transform) -> torch.Tensor:
    return _example_sums(chunk_logits(hidden, head, weights, transform), targets, owners, slots)


def chunked_example_sums(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, owners: torch.Tensor,
                         slots: int, chunk_elements: int = CHUNK_ELEMENTS,
                         transform: Transform = unchanged) -> torch.Tensor:
    """Per-slot sums of next-token log-probs of `transform(head(hidden))` (`owners[t]` is the slot of the token at
    t + 1), a chunk of tokens at a time under activation checkpointing."""
    hidden = hidden[:, :-1].reshape(-1, hidden.size(-1))
    chunk, weights = chunk_tokens(hidden, head, chunk_elements), head_weights(head)
    total = hidden.new_zeros(slots, dtype=torch.float32)
    for start in range(0, targets.numel(), chunk):
        part = slice(start, start + chunk)
        total = total + checkpoint(_chunk_sums, hidden[part], targets[part], owners[part], slots, head, weights,
                                   transform, use_reentrant=False)
    return total


def sequence_logps(model, batch: dict, chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """[examples] each example's summed log-prob of its trained tokens, in batch order, from one forward; packed
    examples kept apart as `loss.model_inputs` keeps them, logits post-processed as the model's forward does."""
    slots = batch["examples"] + 1  # the last slot takes padding and every masked token
    inputs, labels = model_inputs(model, batch)
    owners = laid_out(model, batch["example_ids"], IGNORE)
    targets, owners = labels[:, 1:].reshape(-1), owners[:, 1:].reshape(-1)
    owners = torch.where((owners < 0) | (targets == IGNORE), slots - 1, owners)
    if not chunked_head(model):  # the model's own logits, already post-processed
        logits = model(**inputs).logits
        return _example_sums(logits[:, :-1].reshape(-1, logits.size(-1)), targets, owners, slots)[:-1]
    head, transform = model.get_output_embeddings(), logit_transform(model.config)
    sums, _ = head_forward(model, inputs, lambda hidden: chunked_example_sums(hidden, head, targets, owners, slots,
                                                                              chunk_elements, transform))
    return sums[:-1]


def pair_losses(policy: torch.Tensor, reference: torch.Tensor, response_tokens: torch.Tensor,
                dpo: DpoSection) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each pair's loss and its chosen and rejected rewards (beta times the log-prob gain over the reference),
    from per-example log-probs in pair order (chosen, rejected, chosen, ...)."""
    reference = reference.to(policy.dtype)
    chosen = dpo.beta * (policy[0::2] - reference[0::2])
    rejected = dpo.beta * (policy[1::2] - reference[1::2])
    margin = chosen - rejected
    losses = -F.logsigmoid(margin) * (1 - dpo.label_smoothing) - F.logsigmoid(-margin) * dpo.label_smoothing
    if dpo.sft_weight:
        losses = losses - dpo.sft_weight * policy[0::2] / response_tokens[0::2].clamp(min=1).to(policy.dtype)
    return losses, chosen.detach(), rejected.detach()


def dpo_loss_sum(model, batch: dict, dpo: DpoSection) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch's DPO loss summed over its pairs, and the sums over its pairs of `METRICS` (chosen reward,
    rejected reward, margin, chosen reward above the rejected one); nothing is read back from the device."""
    policy = sequence_logps(model, batch)
    losses, chosen, rejected = pair_losses(policy, batch["reference_logps"], batch["response_tokens"], dpo)
    sums = torch.stack([chosen.sum(), rejected.sum(), (chosen - rejected).sum(), (chosen > rejected).float().sum()])
    return losses.sum(), sums


@torch.no_grad()
def score_examples(model, batches: Iterable[tuple[dict, np.ndarray]], examples: int, device) -> np.ndarray:
    """Every example's sequence log-prob under `model` (float64): this worker scores its `batches` (device batches
    and the global indices of their examples; every worker runs as many forwards), and a sum over the workers
    gives each worker all of them, each example scored by one worker."""
    model.eval()
    values = torch.zeros(examples, dtype=torch.float64, device=device)
    for batch, indices in batches:
        if len(indices):
            values[torch.as_tensor(indices, device=device)] = sequence_logps(model, batch).double()
        else:
            sequence_logps(model, batch)  # a dummy forward: FSDP needs every worker in every forward
    model.train()
    if dist.is_initialized():
        dist.all_reduce(values)
    return values.cpu().numpy()


def reference_path(run_path: str, split: str, data_key: str) -> str:
    return f"{run_path}/reference/{split}-{data_key}.npy"


def read_reference(fs: pafs.FileSystem, path: str, examples: int) -> np.ndarray | None:
    """The stored reference log-probs at `path` when they are there for `examples` examples; None otherwise."""
    try:
        with fs.open_input_stream(path) as stream:
            values = np.load(io.BytesIO(stream.readall()), allow_pickle=False)
    except (FileNotFoundError, ValueError):
        return None
    except OSError:
        if fs.get_file_info(path).type == pafs.FileType.NotFound:
            return None
        raise
    return values if values.shape == (examples,) and values.dtype == np.float64 else None


def write_reference(fs: pafs.FileSystem, path: str, values: np.ndarray) -> None:
    """Write under a temporary name, then move into place: a reader finds the whole file or none."""
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(values, dtype=np.float64), allow_pickle=False)
    directory, name = path.rsplit("/", 1)
    fs.create_dir(directory, recursive=True)
    partial = f"{directory}/.{name}.partial-{uuid.uuid4().hex[:8]}"
    with fs.open_output_stream(partial) as out:
        out.write(buffer.getvalue())
    fs.move(partial, path)
