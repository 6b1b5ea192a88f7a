"""Attention over jagged sequences, at a cost that follows each sample's own length.

Padding a whole batch to its longest history would make every sample cost ``Lmax^2``; with
heavy-tailed lengths that hides the per-sample cost the balancer reasons about. Instead the
samples are sorted by length and cut into groups whose padded size stays within
``max_padding`` times their real token count; each group is one dense
``scaled_dot_product_attention`` call. A sample's cost therefore grows with ``L`` (projections,
feed-forward) and ``L^2`` (scores), as real attention does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def offsets_of(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.long, device=lengths.device)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


def group_by_length(lengths: list[int], max_padding: float) -> list[list[int]]:
    """Sample indices grouped so that ``len(group) * max(L) <= max_padding * sum(L)``.

    Groups are built greedily over samples sorted by decreasing length; the first sample of
    a group sets its padded length.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    longest = total = 0
    for i in order:
        if current and (len(current) + 1) * longest > max_padding * (total + lengths[i]):
            groups.append(current)
            current, total = [], 0
        if not current:
            longest = lengths[i]
        current.append(i)
        total += lengths[i]
    if current:
        groups.append(current)
    return groups


@dataclass
class _Padded:
    index: torch.Tensor  # [g, Lmax] flat token index (0 where padded)
    mask: torch.Tensor  # [g, Lmax] True for real tokens


def _pad_layout(offsets: torch.Tensor, lengths: torch.Tensor, samples: torch.Tensor, width: int) -> _Padded:
    pos = torch.arange(width, device=lengths.device)
    mask = pos[None, :] < lengths[samples][:, None]
    index = torch.where(mask, offsets[samples][:, None] + pos[None, :], torch.zeros_like(pos)[None, :])
    return _Padded(index, mask)


class JaggedLayout:
    """Padded layouts of one batch's groups, for queries (``q_lengths``) and keys (``kv_lengths``).

    Built once per batch and shared by every attention layer.
    """

    def __init__(self, kv_lengths: torch.Tensor, q_lengths: torch.Tensor, max_padding: float) -> None:
        kv_list = kv_lengths.tolist()
        q_list = q_lengths.tolist()
        kv_off, q_off = offsets_of(kv_lengths), offsets_of(q_lengths)
        self.groups = []
        flat_q = []
        for members in group_by_length(kv_list, max_padding):
            samples = torch.tensor(members, dtype=torch.long, device=kv_lengths.device)
            kv = _pad_layout(kv_off, kv_lengths, samples, max(kv_list[i] for i in members))
            q = _pad_layout(q_off, q_lengths, samples, max(max(q_list[i] for i in members), 1))
            self.groups.append((q, kv))
            flat_q.append(q.index[q.mask])
        perm = torch.cat(flat_q) if flat_q else torch.zeros(0, dtype=torch.long)
        # Outputs come out group by group; this puts them back in packed (sample) order.
        self.unpermute = torch.empty_like(perm)
        self.unpermute[perm] = torch.arange(perm.numel(), device=perm.device)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int) -> torch.Tensor:
        """Multi-head attention of packed queries ``q`` over packed keys/values of the same sample."""
        dim = q.shape[-1]
        head_dim = dim // num_heads
        if q.shape[0] == 0:  # no queries at all (every history empty, for self-attention)
            return q.new_zeros((0, dim)) + 0 * k.sum()
        outputs = []
        for qp, kvp in self.groups:
            g, lq = qp.index.shape
            lk = kvp.index.shape[1]
            qh = q[qp.index].view(g, lq, num_heads, head_dim).transpose(1, 2)
            kh = k[kvp.index].view(g, lk, num_heads, head_dim).transpose(1, 2)
            vh = v[kvp.index].view(g, lk, num_heads, head_dim).transpose(1, 2)
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=kvp.mask[:, None, None, :])
            no_keys = ~kvp.mask.any(dim=1)  # a sample with an empty history attends to nothing: zeros
            if no_keys.any():
                out = torch.where(no_keys[:, None, None, None], torch.zeros_like(out), out)
            outputs.append(out.transpose(1, 2).reshape(g, lq, dim)[qp.mask])
        return torch.cat(outputs)[self.unpermute]
