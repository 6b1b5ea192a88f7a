"""Model FLOPs of a batch, counted analytically from its host lengths.

The protocol: a task (the dense module a pipeline trains: ``SeqRecTask``, or another model
kind) counts its own forward with ``flops(uih_lengths, cand_counts) -> float``, given the
batch's per-sample history lengths and candidate counts as host values (a tensor on the CPU,
an array or a list): the sum over the batch's samples, so a caller never reads a device
value to count. ``training_flops`` is three times that (the backward computes a gradient for
both the input and the weight of every matmul: twice the forward).

What is counted: every matmul as ``2 * m * n * k`` (projections, attention scores and their
weighted sums, feed-forward, target attention, the head), with attention at each sample's
own length ``L``, as if every sample ran alone: the padding the jagged attention adds inside
a group of samples (``freescale.model.jagged_attention``) is work the machine does but not
model FLOPs. Elementwise work (norms, activations, softmax, the loss) is left out. These
are the model FLOPs MFU is defined on (as in PaLM's MFU), not the hardware's executed FLOPs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

import numpy as np
import torch

from freescale.config import reads_user_row

if TYPE_CHECKING:
    from freescale.config import ModelConfig

BACKWARD_MULTIPLE = 2.0
"""Backward FLOPs per forward FLOP: each matmul's gradient for its input and for its weight."""


class CountsFlops(Protocol):
    """What a task implements to have its FLOPs counted (``SeqRecTask``; the HSTU task)."""

    def flops(self, uih_lengths, cand_counts) -> float:
        """Forward FLOPs of a batch of samples with these host lengths (summed over samples)."""


def training_flops(task: CountsFlops, uih_lengths, cand_counts) -> float:
    """Forward and backward FLOPs of training ``task`` on a batch with these host lengths."""
    return (1.0 + BACKWARD_MULTIPLE) * task.flops(uih_lengths, cand_counts)


def as_lengths(lengths) -> np.ndarray:
    """Host lengths as a float64 array (refusing a device tensor)."""
    if isinstance(lengths, torch.Tensor) and lengths.device.type != "cpu":
        raise ValueError(f"FLOPs are counted from host lengths; got a tensor on {lengths.device} (reading it would "
                         "make the host wait for the device)")
    return np.asarray(lengths, dtype=np.float64).reshape(-1)


def matmul(m, n, k):
    """FLOPs of an (m x k) @ (k x n) product: a multiply and an add per term."""
    return 2.0 * m * n * k


def mlp(rows, widths: Sequence[int]) -> float:
    """FLOPs of linear layers of ``widths`` (input first) applied to ``rows`` rows."""
    return float(sum(matmul(rows, b, a) for a, b in zip(widths, widths[1:])))


def attention(q_lengths, kv_lengths, qk_dim: int, v_dim: int) -> float:
    """Scores (``q @ k^T``) and weighted sum (``scores @ v``) of every sample at its own lengths,
    all heads together (``qk_dim``, ``v_dim``: the widths summed over heads)."""
    q, kv = as_lengths(q_lengths), as_lengths(kv_lengths)
    return float(np.sum(matmul(q, kv, qk_dim) + matmul(q, v_dim, kv)))


def model_width(cfg: ModelConfig) -> int:
    return cfg.d_model or cfg.embedding_dim


def seqrec_flops(cfg: ModelConfig, uih_lengths, cand_counts) -> float:
    """Forward FLOPs of ``SeqRecTask`` (``model.kind: transformer``) on a batch.

    Per sample of ``L`` history events and ``C`` candidates, width ``D`` (embeddings ``E``),
    feed-forward width ``F``: the projection of ``E``-wide rows to ``D`` (history, candidates,
    user row); per encoder layer the q/k/v and output projections ``2L*D*4D``, the scores and
    weighted sum ``4*L^2*D`` and the feed-forward ``4L*D*F``; the target attention's key/value
    (``2L*D*2D``) and query (``2C*D*D``) projections and its ``4*C*L*D``; the head's MLP per
    candidate.
    """
    L, C = as_lengths(uih_lengths), as_lengths(cand_counts)
    tokens, cands, samples = L.sum(), C.sum(), float(len(L))
    dim = model_width(cfg)
    total = 0.0
    if dim != cfg.embedding_dim:
        total += matmul(tokens + cands + (samples if reads_user_row(cfg) else 0.0), dim, cfg.embedding_dim)
    per_layer = (mlp(tokens, [dim, 3 * dim]) + mlp(tokens, [dim, dim]) + attention(L, L, dim, dim)
                 + mlp(tokens, [dim, cfg.ffn_mult * dim, dim]))
    total += cfg.num_layers * per_layer
    total += mlp(tokens, [dim, 2 * dim]) + mlp(cands, [dim, dim]) + attention(C, L, dim, dim)
    head_in = 4 * dim if reads_user_row(cfg) else 3 * dim
    total += mlp(cands, [head_in, *cfg.mlp_dims, 1])
    return float(total)


def matmul_widths(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(k, n) of the model's main matmuls, ``(tokens x k) @ (k x n)``: the shapes its matmul peak
    is measured at (``freescale.profile.peak``)."""
    dim = model_width(cfg)
    ffn = cfg.ffn_mult * dim
    return sorted({(dim, dim), (dim, 3 * dim), (dim, ffn), (ffn, dim)})
