"""HSTU's tasks in a form ``torch.export`` can capture: padded per sample, no Python branches on data.

Training lays a batch out on the host (``HSTULayout``: per-length groups, masks, relative
positions and time buckets computed in Python from host tensors) and runs the encoder over
packed tokens; ``torch.export`` cannot capture that. Here the same function is computed over
inputs padded per sample, with everything ``HSTULayout`` computes on the host (which slot is
real, each token's relative position, the time bucket of every query/key pair) computed inside
the program from the lengths and the raw timestamps (seconds), so a serving process passes
only rows, lengths and seconds. The modules and weights are the task's own (``HSTULayer``'s
``norm_in``, ``f1``, ``bias``, ``norm_attn``, ``f2``, the encoder's last norm, the heads).

A sample's slots: its history in ``[0, L)`` (``uih_lengths`` real) and, for ranking, its
candidates in ``[L, L + C)`` (``cand_counts`` real). Where a slot lies in the padded tensor
does not matter: the attention reads positions and masks, never slot indices, and they are
those of training's packed sequence (history token ``s`` at position ``s``, every candidate at
the history's end, a candidate seeing the history and itself). Padded slots are never a key
(``where``, so nothing of theirs reaches a real token, not even as ``0 * inf``). The attention's
divisor and the position table are the task's ``max_len`` (never the padded width), so the
outputs equal the training forward's up to the order of float additions.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from freescale.model.hstu import HSTULayer, time_bucket
from freescale.model.hstu_tasks import HSTURankingTask, HSTURetrievalTask, _HSTUTask


def _layout(uih_lengths: torch.Tensor, width: int, uih_timestamps: torch.Tensor, cand_counts: torch.Tensor | None,
            cand_timestamps: torch.Tensor | None, max_len: int):
    """(real [B, S], token position [B, S], mask [B, S, S], relative position index [B, S, S],
    time bucket (unclamped) [B, S, S]) of the padded sequences: ``width`` history slots, then the
    candidates' (if any); the same quantities as ``freescale.model.hstu._group_on_host``."""
    slot = torch.arange(width, device=uih_lengths.device)[None, :]
    history = uih_lengths[:, None]
    is_history = slot < history
    # The next history token's time; the last history token uses its own (the roll's wrap-around
    # is never read).
    query_time = torch.where(slot + 1 < history, uih_timestamps.roll(-1, dims=1), uih_timestamps)
    key_time = uih_timestamps
    position = slot.expand_as(uih_timestamps)
    token_position = history - slot  # 1 + distance from the most recent event
    real = is_history
    if cand_counts is not None:
        cand_slot = torch.arange(cand_timestamps.shape[1], device=cand_counts.device)[None, :]
        is_cand = cand_slot < cand_counts[:, None]
        real = torch.cat([is_history, is_cand], dim=1)
        is_history = torch.cat([is_history, torch.zeros_like(is_cand)], dim=1)
        query_time = torch.cat([query_time, cand_timestamps], dim=1)  # a candidate uses its own
        key_time = torch.cat([key_time, cand_timestamps], dim=1)
        position = torch.cat([position, history.expand_as(cand_timestamps)], dim=1)
        token_position = torch.cat([token_position, torch.zeros_like(cand_timestamps)], dim=1)
    position = position * real
    size = real.shape[1]
    diagonal = torch.eye(size, dtype=torch.bool, device=real.device)[None]
    causal = is_history[:, None, :] & (position[:, None, :] <= position[:, :, None])
    mask = real[:, :, None] & real[:, None, :] & (causal | diagonal)
    relative = position[:, None, :] - position[:, :, None] + max_len - 1
    buckets = time_bucket(query_time[:, :, None] - key_time[:, None, :])
    return real, token_position.clamp(0, max_len), mask, relative, buckets


def _layer(layer: HSTULayer, x: torch.Tensor, mask: torch.Tensor, relative: torch.Tensor,
           buckets: torch.Tensor) -> torch.Tensor:
    """``HSTULayer.forward`` over padded ``x`` [B, S, dim]."""
    B, S, _ = x.shape
    h, dv, dqk = layer.num_heads, layer.linear_dim, layer.attention_dim
    u, v, q, k = torch.split(F.silu(layer.f1(layer.norm_in(x))), [h * dv, h * dv, h * dqk, h * dqk], dim=-1)
    qh = q.reshape(B, S, h, dqk).transpose(1, 2)
    kh = k.reshape(B, S, h, dqk).transpose(1, 2)
    vh = v.reshape(B, S, h, dv).transpose(1, 2)
    bias = layer.bias
    # Relative positions past the table (histories longer than training's) read its last entry.
    rab = (bias.position_weight[relative.clamp(0, bias.position_weight.shape[0] - 1)]
           + bias.time_weight[buckets.clamp(0, bias.num_time_buckets)])
    scores = F.silu(qh @ kh.transpose(-1, -2) + rab[:, None]) / layer.max_len
    weights = torch.where(mask[:, None], scores, torch.zeros_like(scores))
    attended = (weights @ vh).transpose(1, 2).reshape(B, S, h * dv)
    return layer.f2(layer.dropout(layer.norm_attn(attended) * u)) + x


def _encode(task: _HSTUTask, rows: torch.Tensor, token_position: torch.Tensor, mask: torch.Tensor,
            relative: torch.Tensor, buckets: torch.Tensor) -> torch.Tensor:
    """Tokens (as ``_HSTUTask.tokens``) through the encoder (as ``HSTUEncoder.forward``)."""
    x = task.dropout(rows * math.sqrt(task.dim) + task.positions(token_position))
    for layer in task.encoder.layers:
        x = _layer(layer, x, mask, relative, buckets)
    return task.encoder.norm(x)


class ServingHSTURanking(nn.Module):
    """``HSTURankingTask``'s function over padded inputs: logits [B, C, K] (one per label; zeros
    past ``cand_counts``) from each sample's history rows ``uih`` [B, L, D] (``uih_lengths``
    real) and their seconds ``uih_timestamps`` [B, L], its candidates ``cand`` [B, C, D] and
    ``cand_timestamps`` [B, C] (``cand_counts`` real) and its user row ``user`` [B, D]
    (ignored when the model has none)."""

    def __init__(self, task: HSTURankingTask) -> None:
        super().__init__()
        self.task = task
        self.user_features = task.cfg.user_features

    def forward(self, uih: torch.Tensor, uih_lengths: torch.Tensor, uih_timestamps: torch.Tensor, cand: torch.Tensor,
                cand_counts: torch.Tensor, cand_timestamps: torch.Tensor, user: torch.Tensor) -> torch.Tensor:
        t = self.task
        L = uih.shape[1]
        real, token_position, mask, relative, buckets = _layout(uih_lengths, L, uih_timestamps, cand_counts,
                                                                cand_timestamps, t.max_len)
        cand = t.rows_in(cand)
        out = _encode(t, torch.cat([t.rows_in(uih), cand], dim=1), token_position, mask, relative, buckets)
        features = [out[:, L:], cand]
        if self.user_features:
            features.append(t.rows_in(user)[:, None, :].expand(-1, cand.shape[1], -1))
        features = torch.cat(features, dim=-1)
        logits = torch.cat([head(features) for head in t.heads], dim=-1)
        return torch.where(real[:, L:, None], logits, torch.zeros_like(logits))


class ServingHSTUQuery(nn.Module):
    """``HSTURetrievalTask``'s user tower over padded inputs: each sample's query [B, D] (its last
    history position's output through ``queries_of``; zeros for an empty history) from its
    history rows ``uih`` [B, L, D] (``uih_lengths`` real) and their seconds ``uih_timestamps``."""

    def __init__(self, task: HSTURetrievalTask) -> None:
        super().__init__()
        self.task = task

    def forward(self, uih: torch.Tensor, uih_lengths: torch.Tensor, uih_timestamps: torch.Tensor) -> torch.Tensor:
        t = self.task
        _, token_position, mask, relative, buckets = _layout(uih_lengths, uih.shape[1], uih_timestamps, None, None,
                                                             t.max_len)
        out = _encode(t, t.rows_in(uih), token_position, mask, relative, buckets)
        last = (uih_lengths - 1).clamp(min=0)
        query = t.queries_of(out.gather(1, last[:, None, None].expand(-1, 1, out.shape[-1])).squeeze(1))
        return torch.where(uih_lengths[:, None] > 0, query, torch.zeros_like(query))
