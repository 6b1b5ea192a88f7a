"""What a model's forward returns besides the loss, shared by every task (no TorchRec here)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class StepOutput(NamedTuple):
    """What a forward pass reports besides the loss (pipelines return it from ``progress``).

    ``logits`` [sum(cand_counts), K] and ``labels`` [sum(cand_counts), K]: one column per label
    (ranking), or the candidates' scores against their sample's query (retrieval: K = 1, the
    first candidate is the next item). ``queries`` [samples, D] and ``items`` [sum(cand_counts),
    D]: retrieval only, the user tower's last-position output and the item tower's candidate
    vectors (both L2-normalized), which held-out ranking against the whole table needs.
    """

    loss: torch.Tensor
    logits: torch.Tensor
    labels: torch.Tensor
    sample_ids: torch.Tensor
    uih_lengths: torch.Tensor
    batch_index: torch.Tensor
    cand_counts: torch.Tensor
    """Host tensors, like ``uih_lengths``: with them the trainer counts the step's FLOPs (``freescale.model.flops``)."""
    queries: torch.Tensor | None = None
    items: torch.Tensor | None = None
