"""HSTU's two tasks: ranking candidates (target-aware) and retrieving the next item.

Both take what every task takes (``freescale.model.seqrec.TASK_ARGUMENTS``: the rows looked
up, the item ids and the batch's shape and timestamps on the host) and run the HSTU encoder
(``freescale.model.hstu``) over each sample's own sequence:

- ``HSTURankingTask``: the candidates are appended to the history (HSTU's target-aware form):
  each attends to the history and to itself, never to another candidate, so a candidate's
  score does not depend on which others it is ranked with. One head per label reads the
  candidate's encoded token, its own row and the user's row; the loss is the labels' binary
  cross-entropies, summed over labels, averaged over candidates.
- ``HSTURetrievalTask``: next-item prediction. Every history position predicts the item after
  it (the last one: the sample's first candidate, the next item); the query is the position's
  output, L2-normalized, the item vector its row, L2-normalized (the item tower), and the loss
  a sampled softmax at ``task.temperature`` over the positive, the sample's sampled negatives
  (its other candidates) and, with ``task.in_batch_negatives``, the next items of the rank's
  other samples; a negative that is the positive's own item is left out (an accidental hit).
  The loss is averaged over positions; with overlapping training windows (``task.window_stride``
  below ``max_len``) only each window's last ``window_stride`` positions count, the targets the
  window before it did not reach. With ``task.shared_negatives`` every position scores against
  each distinct item among all the rank's samples' negatives instead of its own sample's.
  In evaluation it also returns each sample's query and its candidates' item vectors, which
  ranking against the whole item table needs (``freescale.train.retrieval``).

Every index (which token belongs to which sample, the targets, the padded layouts of the
negatives) is computed on the host from host tensors and copied without waiting.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from freescale.config import reads_user_row
from freescale.device import to_device
from freescale.model.dropout import KeyedDropout, token_keys
from freescale.model.hstu import HSTUEncoder, HSTULayout
from freescale.model.jagged_attention import offsets_of
from freescale.model.output import StepOutput

if TYPE_CHECKING:
    from freescale.config import ModelConfig, TaskConfig


def _within(lengths: torch.Tensor) -> torch.Tensor:
    """Each packed element's position within its sample (host)."""
    return torch.arange(int(lengths.sum())) - torch.repeat_interleave(offsets_of(lengths)[:-1], lengths)


def _owner(lengths: torch.Tensor) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths)


class _L2Normalize(torch.autograd.Function):
    """``F.normalize(x, dim=-1)``, the same forward bits, with a backward of two passes
    (``(g - y * sum(g * y)) / norm``) where autograd's walks the norm, the clamp and the division
    apart: retrieval normalizes every history and candidate row of a batch (about 21000 on
    MovieLens-100K), and that backward was several of the step's milliseconds."""

    EPS = 1e-12

    @staticmethod
    def forward(ctx, x):
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        denominator = norm.clamp(min=_L2Normalize.EPS)
        y = x / denominator
        ctx.save_for_backward(y, norm, denominator)
        return y

    @staticmethod
    def backward(ctx, grad):
        y, norm, denominator = ctx.saved_tensors
        along = (grad * y).sum(-1, keepdim=True).masked_fill_(norm < _L2Normalize.EPS, 0.0)  # clamped: no norm term
        return torch.addcmul(grad, y, along, value=-1.0).div_(denominator)


def _mlp(widths: list[int], out: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(widths[-1], out))


class _HSTUTask(nn.Module):
    """What both tasks share: rows to tokens (projection, scale, positions, dropout) and the encoder."""

    def __init__(self, cfg: ModelConfig, max_len: int, seed: int = 0) -> None:
        super().__init__()
        dim = cfg.d_model or cfg.embedding_dim
        self.seed = seed
        heads = cfg.num_heads
        self.cfg = cfg
        self.dim = dim
        self.max_len = max_len
        self.project = nn.Linear(cfg.embedding_dim, dim) if dim != cfg.embedding_dim else None
        # Position 0 is a candidate's; a history token's is 1 + its distance from the most recent
        # event (stable under truncation), clamped to the table.
        self.positions = nn.Embedding(max_len + 1, dim)
        nn.init.normal_(self.positions.weight, std=0.02)
        self.dropout = KeyedDropout(cfg.dropout, site=0)
        self.encoder = HSTUEncoder(num_layers=cfg.num_layers, dim=dim, num_heads=heads,
                                   attention_dim=cfg.attention_dim or dim // heads,
                                   linear_dim=cfg.linear_dim or dim // heads, max_len=max_len,
                                   num_time_buckets=cfg.num_time_buckets, dropout=cfg.dropout)

    def rows_in(self, rows: torch.Tensor) -> torch.Tensor:
        return self.project(rows) if self.project is not None else rows

    def keys(self, stream_positions: torch.Tensor | None, lengths: torch.Tensor, device) -> torch.Tensor | None:
        """The packed tokens' dropout keys (``freescale.model.dropout``) on ``device``; None in
        evaluation or without the samples' stream positions."""
        if not self.training or stream_positions is None or self.cfg.dropout == 0.0:
            return None
        return to_device(token_keys(self.seed, stream_positions, lengths), device)

    def tokens(self, rows: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor | None) -> torch.Tensor:
        """Input tokens: rows scaled by sqrt(width) (as HSTU's preprocessor does) plus positions."""
        pos = to_device(positions.clamp(max=self.max_len), rows.device)
        return self.dropout(rows * math.sqrt(self.dim) + self.positions(pos), keys)

    def encode(self, x: torch.Tensor, lengths: torch.Tensor, targets: torch.Tensor, timestamps: torch.Tensor,
               keys: torch.Tensor | None) -> torch.Tensor:
        """The encoder over packed tokens ``x`` of samples ``lengths`` long (host; samples without
        a token, such as the item batches of retrieval's evaluation, hold none of ``x``)."""
        some = lengths > 0
        if not bool(some.any()):
            return x
        layout = HSTULayout(lengths[some], targets[some], timestamps, max_len=self.max_len,
                            max_padding=self.cfg.attention_padding, device=x.device)
        layout.dropout_keys = keys
        return self.encoder(x, layout)


class HSTURankingTask(_HSTUTask):
    """Candidates appended to the history, one head per label (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, max_len: int, num_labels: int = 1, seed: int = 0) -> None:
        super().__init__(cfg, max_len, seed)
        width = (3 if reads_user_row(cfg) else 2) * self.dim
        self.heads = nn.ModuleList(_mlp([width, *cfg.mlp_dims], 1) for _ in range(num_labels))

    def sequence(self, uih_lengths: torch.Tensor, cand_counts: torch.Tensor):
        """Host indices of the packed sequences [history, candidates] per sample: ``order`` into
        cat(history tokens, candidate tokens), each token's position, and where each candidate
        lands in the sequences."""
        lengths = uih_lengths + cand_counts
        n_uih = int(uih_lengths.sum())
        within = _within(lengths)
        owner = _owner(lengths)
        in_uih = within < uih_lengths[owner]
        uih_off, cand_off = offsets_of(uih_lengths)[:-1], offsets_of(cand_counts)[:-1]
        order = torch.where(in_uih, uih_off[owner] + within, n_uih + cand_off[owner] + within - uih_lengths[owner])
        positions = torch.where(in_uih, uih_lengths[owner] - within, torch.zeros_like(within))
        cand_at = (~in_uih).nonzero().squeeze(1)
        return lengths, order, positions, cand_at

    def forward(self, uih, cand, user_rows, item_ids, uih_lengths, cand_counts, uih_timestamps, cand_timestamps,
                labels, sample_ids, batch_index, loss_scale, stream_positions=None):
        device = uih.device
        lengths, order, positions, cand_at = self.sequence(uih_lengths, cand_counts)
        keys = self.keys(stream_positions, lengths, device)
        uih, cand = self.rows_in(uih), self.rows_in(cand)
        x = self.tokens(torch.cat([uih, cand])[to_device(order, device)], positions, keys)
        stamps = torch.cat([uih_timestamps, cand_timestamps])[order]
        out = self.encode(x, lengths, cand_counts, stamps, keys)
        features = [out.index_select(0, to_device(cand_at, device)), cand]
        if user_rows is not None:  # each sample's user row once per candidate
            features.append(self.rows_in(user_rows).index_select(0, to_device(_owner(cand_counts), device)))
        features = torch.cat(features, dim=-1)
        logits = torch.cat([head(features) for head in self.heads], dim=-1)
        loss = F.binary_cross_entropy_with_logits(logits, labels, reduction="none").sum(-1).mean() * loss_scale
        return loss, StepOutput(loss.detach(), logits.detach(), labels, sample_ids, uih_lengths, batch_index,
                                cand_counts)

    def flops(self, uih_lengths, cand_counts) -> float:
        """Forward FLOPs (matrix products, 2 m n k) of these samples."""
        uih_lengths, cand_counts = torch.as_tensor(uih_lengths), torch.as_tensor(cand_counts)
        tokens, cands = int((uih_lengths + cand_counts).sum()), int(cand_counts.sum())
        head = sum(2 * cands * lin.in_features * lin.out_features for h in self.heads for lin in h
                   if isinstance(lin, nn.Linear))
        users = len(uih_lengths) if reads_user_row(self.cfg) else 0
        project = 0 if self.project is None else 2 * (tokens + users) * self.cfg.embedding_dim * self.dim
        return float(self.encoder.flops(uih_lengths + cand_counts, cand_counts) + head + project)


class HSTURetrievalTask(_HSTUTask):
    """Next-item prediction with a sampled softmax (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, task: TaskConfig, max_len: int, seed: int = 0) -> None:
        super().__init__(cfg, max_len, seed)
        self.task_cfg = task
        self.unproject = nn.Linear(self.dim, cfg.embedding_dim) if self.project is not None else None

    def item_vectors(self, rows: torch.Tensor) -> torch.Tensor:
        """The item tower: an item's row, L2-normalized (what serving ranks against)."""
        return _L2Normalize.apply(rows)

    def queries_of(self, out: torch.Tensor) -> torch.Tensor:
        """The user tower's last step: an encoded position (normalized by the encoder's last
        LayerNorm), back to the rows' width, L2-normalized."""
        return _L2Normalize.apply(self.unproject(out) if self.unproject is not None else out)

    def forward(self, uih, cand, user_rows, item_ids, uih_lengths, cand_counts, uih_timestamps, cand_timestamps,
                labels, sample_ids, batch_index, loss_scale, stream_positions=None):
        device = uih.device
        n = len(uih_lengths)
        within = _within(uih_lengths)
        owner = _owner(uih_lengths)
        keys = self.keys(stream_positions, uih_lengths, device)
        x = self.tokens(self.rows_in(uih), uih_lengths[owner] - within, keys)
        out = self.encode(x, uih_lengths, torch.zeros_like(uih_lengths), uih_timestamps, keys)
        queries = self.queries_of(out)  # [T, D], one per history position
        items = self.item_vectors(torch.cat([uih, cand]))  # the positions' targets and the candidates
        n_uih = int(uih_lengths.sum())
        cand_off = offsets_of(cand_counts)
        first = n_uih + cand_off[:-1]  # each sample's next item, in cat(uih, cand)

        # A position's target: the next history item, or the sample's next item for the last one.
        last = within == uih_lengths[owner] - 1
        target = torch.where(last, first[owner], torch.arange(n_uih) + 1)
        loss = self._loss(queries, items, item_ids, target, owner, uih_lengths, cand_counts, first) * loss_scale

        # Each sample's query (its last position; zeros without a history), scored against its candidates.
        has = uih_lengths > 0
        q = queries.new_zeros((n, queries.shape[1]))
        q = q.index_copy(0, to_device(has.nonzero().squeeze(1), device),
                         queries.index_select(0, to_device(offsets_of(uih_lengths)[1:][has] - 1, device)))
        cand_items = items[n_uih:]
        logits = (q.index_select(0, to_device(_owner(cand_counts), device)) * cand_items).sum(-1, keepdim=True)
        extra = (q.detach(), cand_items.detach()) if not self.training else (None, None)
        return loss, StepOutput(loss.detach(), logits.detach() / self.task_cfg.temperature, labels, sample_ids,
                                uih_lengths, batch_index, cand_counts, *extra)

    def _loss(self, queries, items, item_ids, target, owner, uih_lengths, cand_counts, first) -> torch.Tensor:
        """Mean over positions of the sampled softmax's cross-entropy (the positive in column 0)."""
        device = queries.device
        stride = self.task_cfg.window_stride
        if 0 < stride < self.max_len:  # overlapping windows: the targets the previous window did not reach
            kept = uih_lengths.clamp(max=stride)  # each sample's last positions, still sample-major
            scored = (_within(uih_lengths) >= (uih_lengths - stride)[owner]).nonzero().squeeze(1)
            queries = queries.index_select(0, to_device(scored, device))
            target, owner, uih_lengths = target[scored], owner[scored], kept
        T = queries.shape[0]
        if T == 0:
            return queries.sum() * 0.0 + items.sum() * 0.0
        tau = self.task_cfg.temperature
        target_ids = item_ids[target]
        B = len(first)
        # The sample's sampled negatives (its candidates after the first), padded per sample.
        negs = (cand_counts - 1).clamp(min=0)
        width = int(negs.max()) if B else 0
        slot = torch.arange(width)
        real = slot[None, :] < negs[:, None]  # [B, width]
        at = torch.where(real, first[:, None] + 1 + slot[None, :], torch.zeros_like(slot)[None, :])
        in_batch = B if self.task_cfg.in_batch_negatives else 0
        shared = bool(width) and self.task_cfg.shared_negatives
        if shared:
            # Each distinct item among all samples' negatives once, at its first draw (a repeat's
            # row holds the same values, and its gradient would go to the same table row).
            drawn = at[real]
            shared_ids, inverse = torch.unique(item_ids[drawn], return_inverse=True)
            first_of = torch.full((len(shared_ids),), len(drawn), dtype=torch.long).scatter_reduce(
                0, inverse, torch.arange(len(drawn)), reduce="amin")
            negatives = drawn[first_of]
        else:
            negatives = at.reshape(-1)
        # Every item row the loss reads, in one gather (one index_add in the backward): the
        # positions' targets, the negatives (padded per sample, or the shared ones), the
        # samples' next items.
        wanted = torch.cat([target, negatives, first[:in_batch]])
        pos_rows, neg_rows, nxt = items.index_select(0, to_device(wanted, device)).split(
            [T, len(negatives), in_batch])
        # The temperature scales the [T, D] queries, not the [T, columns] logits.
        queries = queries / tau
        columns = [(queries * pos_rows).sum(-1, keepdim=True)]
        masks = [torch.zeros((T, 1), dtype=torch.bool)]
        if shared:  # every position against every shared negative
            columns.append(queries @ neg_rows.T)
            masks.append(shared_ids[None, :] == target_ids[:, None])
        elif width:
            # Each sample's positions against its negatives: one batched product over the
            # positions padded per sample ([B, Lmax, D] @ [B, D, width]), real positions kept.
            lmax = int(uih_lengths.max())
            spot = offsets_of(uih_lengths)[:-1][:, None] + torch.arange(lmax)[None, :]
            held = torch.arange(lmax)[None, :] < uih_lengths[:, None]
            padded = queries.index_select(0, to_device(torch.where(held, spot, torch.zeros_like(spot)).reshape(-1),
                                                       device))
            per_sample = torch.bmm(padded.view(B, lmax, -1), neg_rows.view(B, width, -1).transpose(1, 2))
            per_pos = per_sample.reshape(-1, width).index_select(0, to_device(held.reshape(-1).nonzero().squeeze(1),
                                                                              device))
            columns.append(per_pos)
            masks.append(~real[owner] | (item_ids[at][owner] == target_ids[:, None]))
        if in_batch:
            columns.append(queries @ nxt.T)
            masks.append(item_ids[first][None, :] == target_ids[:, None])
        # The columns' fresh concatenation is masked in place (no [T, columns] copy).
        logits = torch.cat(columns, dim=1)
        logits.masked_fill_(to_device(torch.cat(masks, dim=1), device), float("-inf"))
        return F.cross_entropy(logits, logits.new_zeros(T, dtype=torch.long))

    def flops(self, uih_lengths, cand_counts) -> float:
        """Forward FLOPs (matrix products, 2 m n k) of these samples, scoring included (with
        ``task.shared_negatives`` a position's negatives are counted as its sample's own: how many
        distinct items the batch's negatives hold depends on the ids, not on these sizes)."""
        uih_lengths, cand_counts = torch.as_tensor(uih_lengths), torch.as_tensor(cand_counts)
        T, B = int(uih_lengths.sum()), len(uih_lengths)
        stride = self.task_cfg.window_stride
        scored = int(uih_lengths.clamp(max=stride).sum()) if 0 < stride < self.max_len else T  # the loss's positions
        d = self.cfg.embedding_dim
        negatives = int(cand_counts.max() - 1) if B else 0
        scores = 2 * scored * d * (1 + max(negatives, 0) + (B if self.task_cfg.in_batch_negatives else 0))
        project = 0 if self.project is None else 4 * T * d * self.dim
        return float(self.encoder.flops(uih_lengths, torch.zeros_like(uih_lengths)) + scores + project)
