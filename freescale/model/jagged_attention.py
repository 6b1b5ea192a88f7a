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

from freescale.device import to_device


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
    real: torch.Tensor  # positions of the real tokens in the flattened [g * Lmax]


def _pad_layout(offsets: torch.Tensor, lengths: torch.Tensor, samples: torch.Tensor, width: int) -> _Padded:
    pos = torch.arange(width)
    mask = pos[None, :] < lengths[samples][:, None]
    index = torch.where(mask, offsets[samples][:, None] + pos[None, :], torch.zeros_like(pos)[None, :])
    return _Padded(index, mask, mask.reshape(-1).nonzero().squeeze(1))


def _host_lengths(lengths: torch.Tensor, name: str) -> torch.Tensor:
    if lengths.device.type != "cpu":
        raise ValueError(f"JaggedLayout: {name} must be host tensors (a Batch keeps them on the host): reading them "
                         f"from {lengths.device} would make the host wait for the device")
    return lengths


class JaggedLayout:
    """Padded layouts of one batch's groups, for queries (``q_lengths``) and keys (``kv_lengths``).

    Built once per batch and shared by every attention layer. The lengths are host tensors and
    the layout is computed on the host (which samples share a group, where each token sits in
    it); only the resulting indices and masks go to ``device``, with non-blocking copies, so
    building it never makes the host wait for the device.
    """

    def __init__(self, kv_lengths: torch.Tensor, q_lengths: torch.Tensor, max_padding: float,
                 device: torch.device | str = "cpu") -> None:
        kv_lengths = _host_lengths(kv_lengths, "kv_lengths")
        q_lengths = _host_lengths(q_lengths, "q_lengths")
        kv_list = kv_lengths.tolist()
        q_list = q_lengths.tolist()
        kv_off, q_off = offsets_of(kv_lengths), offsets_of(q_lengths)
        self.groups = []
        flat_q = []
        for members in group_by_length(kv_list, max_padding):
            samples = torch.tensor(members, dtype=torch.long)
            kv = _pad_layout(kv_off, kv_lengths, samples, max(kv_list[i] for i in members))
            q = _pad_layout(q_off, q_lengths, samples, max(max(q_list[i] for i in members), 1))
            no_keys = ~kv.mask.any(dim=1)  # a sample with an empty history attends to nothing: zeros
            flat_q.append(q.index[q.mask])
            self.groups.append((_on(q, device), _on(kv, device),
                                to_device(no_keys, device) if bool(no_keys.any()) else None))
        perm = torch.cat(flat_q) if flat_q else torch.zeros(0, dtype=torch.long)
        # Outputs come out group by group; this puts them back in packed (sample) order.
        unpermute = torch.empty_like(perm)
        unpermute[perm] = torch.arange(perm.numel())
        self.unpermute = to_device(unpermute, device)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int) -> torch.Tensor:
        """Multi-head attention of packed queries ``q`` over packed keys/values of the same sample."""
        dim = q.shape[-1]
        head_dim = dim // num_heads
        if q.shape[0] == 0:  # no queries at all (every history empty, for self-attention)
            return q.new_zeros((0, dim)) + 0 * k.sum()
        outputs = []
        for qp, kvp, no_keys in self.groups:
            g, lq = qp.index.shape
            lk = kvp.index.shape[1]
            qh = q[qp.index].view(g, lq, num_heads, head_dim).transpose(1, 2)
            kh = k[kvp.index].view(g, lk, num_heads, head_dim).transpose(1, 2)
            vh = v[kvp.index].view(g, lk, num_heads, head_dim).transpose(1, 2)
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=kvp.mask[:, None, None, :])
            if no_keys is not None:
                out = torch.where(no_keys[:, None, None, None], torch.zeros_like(out), out)
            # The real queries, by position (a boolean mask would make the host wait for a count).
            outputs.append(out.transpose(1, 2).reshape(g * lq, dim).index_select(0, qp.real))
        return torch.cat(outputs)[self.unpermute]


def _on(padded: _Padded, device) -> _Padded:
    return _Padded(*(to_device(t, device) for t in (padded.index, padded.mask, padded.real)))
