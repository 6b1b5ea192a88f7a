"""The dense part of the model in a form ``torch.export`` can capture: padded, no Python branches.

Training runs ``SeqRecTask`` over jagged histories, grouping samples by length in Python
(``JaggedLayout``) so that each sample costs what its length says; ``torch.export`` cannot
capture Python control flow that depends on the data. ``ServingDense`` computes the same
function over histories padded to the batch's longest, with masks: every real token sees the
same keys, the same positions and the same weights (``SeqRecTask``'s own modules), so its
outputs equal the training forward's up to the order of float additions. Padded positions are
never a key (masked), so nothing of theirs reaches a real token; a sample with an empty history
attends to nothing (zeros), as in training.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from freescale.model.seqrec import SeqRecTask


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor,
                     num_heads: int) -> torch.Tensor:
    """Multi-head attention of ``q`` [B, Lq, D] over ``k``, ``v`` [B, Lk, D] where ``key_mask``
    [B, Lk] is True; zeros for a sample with no key."""
    B, Lq, D = q.shape
    Lk = k.shape[1]
    hd = D // num_heads
    qh = q.reshape(B, Lq, num_heads, hd).transpose(1, 2)
    kh = k.reshape(B, Lk, num_heads, hd).transpose(1, 2)
    vh = v.reshape(B, Lk, num_heads, hd).transpose(1, 2)
    # A sample with no key gets one all-true mask row (no NaN) and zeros after.
    any_key = key_mask.any(dim=1)
    mask = key_mask | ~any_key[:, None]
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask[:, None, None, :])
    out = out.transpose(1, 2).reshape(B, Lq, D)
    return torch.where(any_key[:, None, None], out, torch.zeros_like(out))


class ServingDense(nn.Module):
    """``SeqRecTask``'s function over padded inputs: logits [B, C, K] (one per label) from the rows of each sample's
    history ``uih`` [B, L, D] (``uih_lengths`` real), its candidates ``cand`` [B, C, D]
    (``cand_counts`` real) and its user row ``user`` [B, D] (zeros when the model has none)."""

    def __init__(self, task: SeqRecTask) -> None:
        super().__init__()
        self.task = task
        self.num_heads = task.cfg.num_heads
        self.user_features = task.cfg.user_features

    def forward(self, uih: torch.Tensor, uih_lengths: torch.Tensor, cand: torch.Tensor, cand_counts: torch.Tensor,
                user: torch.Tensor) -> torch.Tensor:
        t = self.task
        L = uih.shape[1]
        pos = torch.arange(L, device=uih.device)
        mask = pos[None, :] < uih_lengths[:, None]
        if t.project is not None:
            uih, cand, user = t.project(uih), t.project(cand), t.project(user)
        # Position counted from the most recent event (as in training), clamped to the table.
        from_end = (uih_lengths[:, None] - 1 - pos[None, :]).clamp(0, t.positions.num_embeddings - 1)
        x = uih + t.positions(from_end)
        for layer in t.layers:
            q, k, v = layer.qkv(layer.norm1(x)).chunk(3, dim=-1)
            x = x + layer.proj(masked_attention(q, k, v, mask, self.num_heads))
            x = x + layer.ffn(layer.norm2(x))
        x = t.norm(x)
        k, v = t.target_kv(x).chunk(2, dim=-1)
        attended = masked_attention(t.target_q(cand), k, v, mask, self.num_heads)
        features = [cand, attended, cand * attended]
        if self.user_features:
            features.append(user[:, None, :].expand(-1, cand.shape[1], -1))
        logits = t.head(torch.cat(features, dim=-1))
        real = torch.arange(cand.shape[1], device=cand.device)[None, :, None] < cand_counts[:, None, None]
        return torch.where(real, logits, torch.zeros_like(logits))
