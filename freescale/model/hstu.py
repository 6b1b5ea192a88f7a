"""HSTU layers (Zhai et al., ICML 2024) over jagged sequences, batch-invariant to the bit.

The layer as published (generative-recommenders, ``research/modeling/sequential/hstu.py``)::

    u, v, q, k = split(SiLU(f1(LayerNorm(x))))             # one Linear: dim -> h * (2 dv + 2 dqk)
    A = SiLU(Q K^T + rab) / N   per head, masked, no softmax # N = max_len, a constant
    y = f2(dropout(LayerNorm(A V) * U)) + x                 # f2: h * dv -> dim

The relative attention bias ``rab[i, j]`` is shared by the heads and learned per layer, as the
reference's ``RelativeBucketedTimeAndPositionBasedBias``: ``pos_w[j - i + N - 1]`` (a table of
``2N - 1``; the reference reaches the same entry through a pad/repeat/reshape Toeplitz trick)
plus ``ts_w[bucket(|t_query(i) - t_j|)]`` with ``bucket(x) = floor(log(max(x, 1)) / 0.301)``
clamped to ``[0, num_time_buckets]`` (``num_time_buckets + 1`` weights, the log taken in
float32 as the reference does). ``t_query(i)`` is the timestamp of the token after ``i``: the
time at which the prediction made at ``i`` is used. Where this differs from the reference:

- the last history token has no next token; the reference reads the timestamp one past it,
  which for a sample shorter than ``N`` is the zero padding of its dense ``[B, N]`` tensor (so
  ``|0 - t_j|`` lands in the top bucket) and only for a full-length sample its own. Here it is
  always its own: a value that depends on the padding would make the output depend on how the
  sample was laid out;
- candidates (ranking) are not in the reference's research model. Here a candidate sits at
  the history's end (position ``H``, all of a sample's candidates alike), attends to the
  history and to itself, and uses its own timestamp; the last history token does not read a
  candidate's, so the history is encoded the same whatever candidates follow it, and no
  candidate sees another (the target-aware mask of generative-recommenders' newer ``STU``);
- the LayerNorms carry learned scale and shift, and ``f1`` a bias (as the newer ``STU``; the
  research model's norms have none), with the reference's ``eps = 1e-6``.

Padding is never seen: ``N`` is the configured ``max_len``, never a group's padded length,
and padded keys are cut by the mask, applied with the ``1/N`` as one multiply by a weight that
is 0 there. A padded slot holds a copy of its own sample's first token, so what it multiplies
is a value of the sample itself, never another sample's nor uninitialized memory.

**Cost follows each sample's own length, and a sample never depends on its batch-mates.**
The balancer moves samples between ranks, so a sample's rows must come out the same, bitwise,
whichever batch carries it. A sample is padded to the first rung of a geometric ladder of
lengths (ratio ``max_padding``, capped at ``max_len``) above its own length, so its padded
length, and with it the shape of every product it takes part in, is a function of its own
length alone; samples on the same rung form one group, one batched matmul each for ``QK^T``
and ``AV``. The masks, relative positions and time buckets are computed on the host once per
batch (``HSTULayout``) and copied with ``to_device`` (never a device read on the host). The
token-wise parts (LayerNorm, ``f1``, ``f2``) work on the packed ``[T, dim]`` rows: measured
here (oneDNN/MKL fp32 GEMM on CPU), a row's result does not depend on how many rows share the
call (``tests/unit/test_hstu.py`` moves samples into batches of other sizes and compares with
``torch.equal``); the batched matmuls' results do not depend on the group's sample count.

**Why this way** (``scripts/bench_hstu_layouts.py --repeats 3 --iters 1``: forward+backward of
2 layers, dim 64, 4 heads, batch 32, lognormal lengths median 48 plus tails of 530 and 900
tokens, 3707 tokens; 2 shared CPU cores, variants alternated, 3 rounds): per-own-length groups
1.2-1.5 s (4205 padded tokens); the batch padded to its longest (28800 padded tokens) 9.1-16.5
s, 7.6-11x; the same with fbgemm's ``jagged_to_padded_dense`` 8.9-17.5 s, 7.4-11.7x;
``torch.nested`` (strided; the jagged layout refuses ragged x ragged matmul on CPU) 30-41 s,
25-27x; a loop of one sample per group 1.2-9.4 s, 1.0-6.3x. One round was disturbed by other
workers (groups 14.4 s, ratios 0.3-2.1x there). Every variant agrees with the unpadded
per-sample result within 5e-7 (outputs) and 3e-6 (input gradients). fbgemm_gpu_cpu has no HSTU
attention op (fbgemm's HSTU kernels are a separate CUDA-only target).

**Speed on CPU** (``scripts/bench_hstu_step.py --repeats 3 --batches 3 --iters 3 --threads 1
--baseline 2e1da4a``: the task's dense forward+backward on the first 3 train batches of
``configs/hstu_ml100k.yaml`` (retrieval, 128 samples, about 5000 tokens) and
``configs/hstu_ranking.yaml`` (ranking, 64 samples, histories up to 512), each batch's best of
3 passes, the code before this work timed in the same run, rounds alternated; 1 thread, 2
shared cores): retrieval 117-130 ms/step before, 90-98 ms after (1.25-1.38x, MFU 18-20% ->
24-27%), ranking 80-83 ms before, 53-56 ms after (1.43-1.58x, MFU 10% -> 14-15%). With torch's
2 threads, which the other workers' load slowed below 1 thread in that run
(``docs/results/bench_hstu_step_threads2.json``): retrieval 288-379 -> 209-246 ms (1.34-1.55x),
ranking 190-235 -> 143-215 ms (1.02-1.50x). What it took, largest first: the host layout's ``[g, P, P]`` tensors in a few
in-place passes (ranking's layout 190-380 ms -> 26-45 ms under load, 1 thread); the attention
of a group as one autograd function (``_GroupAttention``, two passes over the scores in the
backward) fed by one gather and read back by one scatter for all groups; the bias as one gather
per layer from a (position, bucket) table; in retrieval, the item rows in one gather and the L2
normalization's backward in two passes. What is left is mostly the products themselves
(``mm``/``bmm``), the head-major copies around them, and retrieval's ``[T, 257]`` logits.
(Those figures drew dropout masks from torch's generator; dropout is keyed now,
``freescale.model.dropout``: its masks are hashes, a few integer operations per element.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from freescale.device import to_device
from freescale.model.dropout import KeyedDropout

LOG_BUCKET_BASE = 0.301
"""The reference's divisor of the natural log of a time difference: buckets about 1.35x wide."""


def bucket_ladder(max_len: int, max_padding: float) -> list[int]:
    """Padded lengths a sample may get: 1, then each rung ``ceil(previous * max_padding)`` (at
    least one more), up to ``max_len``; a sample's padded length is the first rung >= its own,
    so it is below ``max_padding * L + 1``."""
    rungs = [1]
    while rungs[-1] < max_len:
        rungs.append(min(max_len, max(rungs[-1] + 1, math.ceil(rungs[-1] * max_padding))))
    return rungs


def time_bucket(diff: torch.Tensor) -> torch.Tensor:
    """``floor(log(max(|diff|, 1)) / 0.301)``, unclamped, in float32 as the reference computes it."""
    seconds = diff.abs().clamp_(min=1).to(torch.float32)
    return seconds.log_().div_(LOG_BUCKET_BASE).long()


@dataclass
class HSTUGroup:
    """One padded group: ``g`` samples of padded length ``P``."""

    index: torch.Tensor  # [g, P] packed token index of each slot (the sample's first token where padded)
    real: torch.Tensor  # positions of the real tokens in the flattened [g * P]
    mask: torch.Tensor  # [g, P, P] bool: query i may attend to key j
    positions: torch.Tensor  # [g, P, P] int64: j's position - i's position + N - 1
    time_buckets: torch.Tensor  # [g, P, P] int64: bucket(|t_query(i) - t_j|), unclamped
    weight: torch.Tensor  # [g, 1, P, P] float32: 1 / N where the mask allows, 0 elsewhere


def _host(tensor: torch.Tensor, name: str) -> torch.Tensor:
    if tensor.device.type != "cpu":
        raise ValueError(f"HSTULayout: {name} must be a host tensor (a Batch keeps it on the host), got one on "
                         f"{tensor.device}: reading it would make the host wait for the device")
    return tensor.long()


class HSTULayout:
    """The groups of one batch, built once from HOST tensors and shared by every HSTU layer.

    ``lengths`` [B]: tokens per sample (history followed by ``targets`` candidates);
    ``targets`` [B]: the candidates at each sample's end (ranking; 0 for retrieval);
    ``timestamps`` [sum(lengths)]: seconds per token; ``max_len``: N, the configured maximum
    tokens per sample (the attention's divisor and the relative-position table's size);
    ``max_padding``: the ratio of the padded-length ladder (``model.attention_padding``).
    Everything is computed on the host; only the resulting tensors go to ``device``, with
    non-blocking copies.
    """

    def __init__(self, lengths: torch.Tensor, targets: torch.Tensor, timestamps: torch.Tensor, max_len: int,
                 max_padding: float, device: torch.device | str = "cpu") -> None:
        lengths = _host(lengths, "lengths")
        targets = _host(targets, "targets")
        timestamps = _host(timestamps, "timestamps")
        if lengths.shape != targets.shape or lengths.dim() != 1:
            raise ValueError(f"HSTULayout: lengths and targets must be [B], got {tuple(lengths.shape)} and "
                             f"{tuple(targets.shape)}")
        if timestamps.shape != (int(lengths.sum()),):
            raise ValueError(f"HSTULayout: timestamps must be [sum(lengths)] = [{int(lengths.sum())}], "
                             f"got {tuple(timestamps.shape)}")
        if bool((lengths > max_len).any()) or bool((lengths < 1).any()):
            raise ValueError(f"HSTULayout: lengths must be in [1, max_len={max_len}], got {lengths.tolist()}")
        if bool((targets < 0).any()) or bool((targets >= lengths).any()):
            raise ValueError("HSTULayout: targets must be in [0, lengths) (a sample needs a history token), "
                             f"got {targets.tolist()} for lengths {lengths.tolist()}")
        self.max_len = max_len
        self.lengths = lengths.tolist()
        self.targets = targets.tolist()
        self.device = device
        offsets = torch.zeros(len(self.lengths) + 1, dtype=torch.long)
        torch.cumsum(lengths, 0, out=offsets[1:])
        self.groups: list[HSTUGroup] = []
        order, rows, gather, start = [], [], [], 0
        for padded, members in self.grouping(self.lengths, max_len, max_padding):
            samples = torch.tensor(members, dtype=torch.long)
            group = _group_on_host(offsets[samples], lengths[samples], targets[samples], timestamps, padded, max_len)
            order.append(group.index.reshape(-1)[group.real])
            rows.append(group.real + start)
            gather.append(group.index.reshape(-1))
            start += group.index.numel()
            self.groups.append(HSTUGroup(*(to_device(t, device) for t in (
                group.index, group.real, group.mask, group.positions, group.time_buckets, group.weight))))
        # Every group's padded rows, concatenated: ``gather`` takes them from the packed tokens (one
        # gather for all groups) and ``scatter`` puts each packed token's output row back.
        self.sizes = [g.index.numel() for g in self.groups]
        self.gather = to_device(torch.cat(gather), device)
        scatter = torch.empty(int(lengths.sum()), dtype=torch.long)
        scatter[torch.cat(order)] = torch.cat(rows)
        self.scatter = to_device(scatter, device)
        self.dropout_keys: torch.Tensor | None = None
        """int64 [T] token keys of ``freescale.model.dropout`` on the device (set by the task);
        None: the layers' dropout draws from torch's generator."""
        self._clamped: dict[int, list[torch.Tensor]] = {}
        self._bias_index: dict[int, torch.Tensor] = {}

    @staticmethod
    def grouping(lengths: list[int], max_len: int, max_padding: float) -> list[tuple[int, list[int]]]:
        """(padded length, sample indices in batch order) per group: one group per rung of the
        ladder that some sample's length falls on."""
        rungs = bucket_ladder(max_len, max_padding)
        by_rung: dict[int, list[int]] = {}
        for i, length in enumerate(lengths):
            by_rung.setdefault(next(r for r in rungs if r >= length), []).append(i)
        return sorted(by_rung.items())

    def time_buckets(self, num_buckets: int) -> list[torch.Tensor]:
        """Each group's time buckets clamped to ``[0, num_buckets]`` (on the device, once per batch)."""
        if num_buckets not in self._clamped:
            self._clamped[num_buckets] = [g.time_buckets.clamp(max=num_buckets) for g in self.groups]
        return self._clamped[num_buckets]

    def bias_index(self, num_buckets: int) -> torch.Tensor:
        """Every group's ``[g, P, P]`` entries of the bias, flattened and concatenated, as indices
        into the table ``pos_w[:, None] + ts_w[None, :]`` of ``2N - 1`` rows and ``num_buckets + 1``
        columns: ``position * (num_buckets + 1) + clamped bucket`` (on the device, once per batch;
        each layer then reads its bias with one gather)."""
        if num_buckets not in self._bias_index:
            self._bias_index[num_buckets] = torch.cat([
                g.time_buckets.clamp(max=num_buckets).add_(g.positions, alpha=num_buckets + 1).reshape(-1)
                for g in self.groups])
        return self._bias_index[num_buckets]


def _group_on_host(offsets: torch.Tensor, lengths: torch.Tensor, targets: torch.Tensor, timestamps: torch.Tensor,
                   padded: int, max_len: int) -> HSTUGroup:
    slot = torch.arange(padded)[None, :]
    history = (lengths - targets)[:, None]
    real = slot < lengths[:, None]
    is_history = slot < history
    # A padded slot holds a copy of its own sample's first token: whatever that token's values, they
    # reach no other sample (and the mask's zero weight keeps them out of its own rows).
    index = torch.where(real, offsets[:, None] + slot, offsets[:, None])
    # Candidates all sit at the history's end; padded slots at 0 (masked, but in the table's range).
    position = torch.where(is_history, slot, history) * real
    key_time = torch.where(real, timestamps[index], 0)
    # The next history token's time; the last history token and every candidate use their own.
    query_time = torch.where(slot + 1 < history, timestamps[torch.where(slot + 1 < history, index + 1, 0)], key_time)
    # The [g, P, P] tensors are the layout's cost (P up to max_len): each is made in as few
    # passes as it takes, in place where it can be.
    mask = position[:, None, :] <= position[:, :, None]
    mask &= is_history[:, None, :]
    mask |= torch.eye(padded, dtype=torch.bool)
    mask &= real[:, :, None]
    mask &= real[:, None, :]
    positions = position[:, None, :] - position[:, :, None]
    positions += max_len - 1
    weight = torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(mask, 1.0 / max_len)
    return HSTUGroup(
        index=index,
        real=real.reshape(-1).nonzero().squeeze(1),
        mask=mask,
        positions=positions,
        time_buckets=time_bucket(query_time[:, :, None] - key_time[:, None, :]),
        weight=weight[:, None],
    )


class RelativeBias(nn.Module):
    """``rab[i, j] = pos_w[pos(j) - pos(i) + N - 1] + ts_w[bucket(|t_query(i) - t_j|)]``, shared by the heads."""

    def __init__(self, max_len: int, num_time_buckets: int) -> None:
        super().__init__()
        self.num_time_buckets = num_time_buckets
        self.position_weight = nn.Parameter(torch.empty(2 * max_len - 1).normal_(std=0.02))
        self.time_weight = nn.Parameter(torch.empty(num_time_buckets + 1).normal_(std=0.02))

    def forward(self, layout: HSTULayout) -> list[torch.Tensor]:
        """One ``[g, P, P]`` bias per group: one gather from the table of every (position, bucket)
        sum (the same float additions, once per table entry instead of once per pair)."""
        table = (self.position_weight[:, None] + self.time_weight[None, :]).reshape(-1)
        biases = table.index_select(0, layout.bias_index(self.num_time_buckets))
        return [b.view(g.positions.shape) for g, b in zip(layout.groups, biases.split(
            [g.positions.numel() for g in layout.groups]))]


class HSTULayer(nn.Module):
    """One HSTU layer over packed ``[T, dim]`` tokens (see the module docstring)."""

    def __init__(self, dim: int, num_heads: int, attention_dim: int, linear_dim: int, max_len: int,
                 num_time_buckets: int, dropout: float, site: int = 1) -> None:
        super().__init__()
        self.dim, self.num_heads, self.max_len = dim, num_heads, max_len
        self.attention_dim, self.linear_dim = attention_dim, linear_dim
        self.norm_in = nn.LayerNorm(dim, eps=1e-6)
        self.f1 = nn.Linear(dim, num_heads * (2 * linear_dim + 2 * attention_dim))
        nn.init.normal_(self.f1.weight, std=0.02)
        nn.init.zeros_(self.f1.bias)
        self.bias = RelativeBias(max_len, num_time_buckets)
        self.norm_attn = nn.LayerNorm(num_heads * linear_dim, eps=1e-6)
        self.dropout = KeyedDropout(dropout, site)
        self.f2 = nn.Linear(num_heads * linear_dim, dim)
        nn.init.xavier_uniform_(self.f2.weight)

    def forward(self, x: torch.Tensor, layout: HSTULayout) -> torch.Tensor:
        h, dv, dqk = self.num_heads, self.linear_dim, self.attention_dim
        u, v, q, k = torch.split(F.silu(self.f1(self.norm_in(x))), [h * dv, h * dv, h * dqk, h * dqk], dim=-1)
        attended = self.attend(q, k, v, layout)
        return self.f2(self.dropout(self.norm_attn(attended) * u, layout.dropout_keys)) + x

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: HSTULayout) -> torch.Tensor:
        """``SiLU(QK^T + rab) / N`` masked, times ``V``: one batched matmul pair per group."""
        h, dv, dqk = self.num_heads, self.linear_dim, self.attention_dim
        qs, ks, vs = (t.index_select(0, layout.gather).split(layout.sizes) for t in (q, k, v))
        outputs = []
        for group, rab, qg, kg, vg in zip(layout.groups, self.bias(layout), qs, ks, vs):
            g, padded = group.index.shape
            out = _GroupAttention.apply(qg.view(g, padded, h, dqk).transpose(1, 2),
                                        kg.view(g, padded, h, dqk).transpose(1, 2),
                                        vg.view(g, padded, h, dv).transpose(1, 2), rab, group.weight)
            outputs.append(out.transpose(1, 2).reshape(g * padded, h * dv))
        return torch.cat(outputs).index_select(0, layout.scatter)


class _GroupAttention(torch.autograd.Function):
    """One group's ``(SiLU(Q K^T + rab) * weight) V``.

    The same arithmetic as the composed ops, with a backward written for it: autograd's
    would keep and walk a ``[g, h, P, P]`` tensor per elementwise op (the bias add, SiLU, the
    division, the mask); here the backward is two passes over the scores (the mask and ``1/N``
    as one multiply, then SiLU's derivative). ``weight`` is ``1/N`` where the mask allows and 0
    elsewhere, so a padded slot adds an exact zero (its rows hold a copy of its own sample's first
    token, never uninitialized memory).
    """

    @staticmethod
    def forward(ctx, q, k, v, rab, weight):
        scores = torch.matmul(q, k.transpose(-1, -2))
        scores += rab[:, None]
        attention = F.silu(scores).mul_(weight)
        ctx.save_for_backward(q, k, v, scores, attention, weight)
        return torch.matmul(attention, v)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, scores, attention, weight = ctx.saved_tensors
        grad_v = torch.matmul(attention.transpose(-1, -2), grad_out)
        grad_scores = torch.matmul(grad_out, v.transpose(-1, -2)).mul_(weight)
        grad_scores = torch.ops.aten.silu_backward(grad_scores, scores)
        grad_q = torch.matmul(grad_scores, k)
        grad_k = torch.matmul(grad_scores.transpose(-1, -2), q)
        return grad_q, grad_k, grad_v, grad_scores.sum(1), None


class HSTUEncoder(nn.Module):
    """``num_layers`` HSTU layers and a final LayerNorm."""

    def __init__(self, num_layers: int, dim: int, num_heads: int, attention_dim: int, linear_dim: int, max_len: int,
                 num_time_buckets: int, dropout: float) -> None:
        super().__init__()
        # Dropout sites 1, 2, ...: a layer's masks are its own (site 0 is the task's input dropout).
        self.layers = nn.ModuleList(HSTULayer(dim, num_heads, attention_dim, linear_dim, max_len, num_time_buckets,
                                              dropout, site=1 + i) for i in range(num_layers))
        self.norm = nn.LayerNorm(dim, eps=1e-6)

    def forward(self, x: torch.Tensor, layout: HSTULayout) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, layout)
        return self.norm(x)

    def flops(self, lengths: list[int] | torch.Tensor, targets: list[int] | torch.Tensor | None = None) -> float:
        """Forward FLOPs of these samples (matmuls, ``2 m n k``; elementwise ops left out).

        Per layer: ``f1`` and ``f2`` on every token, and the attention as the dense ``L x L``
        products the padded path computes for each sample's own ``L`` (padding left out).
        Candidates are rows of that product like any token, so ``targets`` changes nothing;
        it is taken so that callers pass a sample's shape whole.
        """
        del targets
        lengths = [int(n) for n in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
        if not self.layers:
            return 0.0
        first = self.layers[0]
        h, dv, dqk, dim = first.num_heads, first.linear_dim, first.attention_dim, first.dim
        tokens = sum(lengths)
        squares = sum(n * n for n in lengths)
        projections = 2 * tokens * dim * h * (2 * dv + 2 * dqk) + 2 * tokens * h * dv * dim
        attention = 2 * squares * h * dqk + 2 * squares * h * dv
        return float(len(self.layers) * (projections + attention))
