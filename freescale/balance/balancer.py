"""The run-time balancer: every global batch re-partitioned across a replica group's ranks.

Protocol, per global batch ``k`` (each rank starts from its contiguous slice, in time order):

I.   all-gather every rank's per-sample (UIH length, candidate count, labels per candidate, user and
     item side-feature slots);
II.  every rank solves the partition of the global batch from the calibrated cost
     (``cost(L, C)``, pure and deterministic, so no rank needs to be told the result), as far
     as it needs it: its own part and the ranks its own samples go to (``RANK_VIEWS``:
     ``hierarchical`` solves the host split and only the hosts involved, the others the whole
     partition), the same on every rank as the whole partition;
III. all-to-all the samples (meta, UIH ids and times, candidate ids and times, labels, side
     features) to their new ranks. Split sizes follow from (I) and (II), so no size exchange precedes the payload.

Rank ``r`` receives its samples grouped by source rank, each group in the source's order;
sources are consecutive slices of the global batch, so the result is in global time order.

Read-ahead: ``batches()`` runs the three stages off the trainer's main thread, on the
balancer's own thread (``CollectiveReadAhead``), batch after batch, starting batch ``k`` once
training has taken batch ``k - read_ahead``; the loader's iterator is read on that thread too.
The main thread only takes finished batches: its wait is the timeline's ``data`` span (the
bubble report's data wait), and the stages are the ``balance`` range of a profiler trace, on
the thread ``freescale-balancer``. The thread issues the collectives, a batch at a time, on the
balancer's own process group, in the same order on every rank; closing lets it finish the
batches its window still allows, so every rank stops after the same batch (see
``freescale.balance.read_ahead``). An error on the thread (a failed collective, the loader's)
is raised by the ``next()`` that wants that batch, as itself.

With ``vbs`` ranks get unequal sample counts. Each rank's mean loss is then multiplied by
``ranks * local_candidates / global_candidates``: DDP averages gradients over ranks, so the
result is the gradient of the mean loss over the whole global batch, the same as with equal
counts (in expectation over partitions; exactly, for a fixed batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from freescale.balance.cost import CostModel
from freescale.balance.partition import RANK_VIEWS
from freescale.balance.read_ahead import CollectiveReadAhead
from freescale.data.batch import Batch, Samples, SideLayout
from freescale.profile.timeline import phase

_META = 5  # sample id, user id, UIH length, candidate count, stream position


class Balancer:
    def __init__(self, partition: str, cost_model: CostModel, transport, *, user_hash_size: int,
                 normalize_loss: bool, read_ahead: int = 2) -> None:
        self.view = RANK_VIEWS[partition]
        self.cost_model = cost_model
        self.transport = transport
        self.rank = transport.rank
        self.world_size = transport.world_size
        self.user_hash_size = user_hash_size
        self.normalize_loss = normalize_loss
        self.read_ahead = read_ahead
        self._ahead: CollectiveReadAhead | None = None

    # The three stages ----------------------------------------------------------------------

    def gather_sizes(self, local: Samples):
        """Stage I: issue the all-gather of (L, C, K, user slots, item slots); ``wait()`` gives the
        global [N, 5] array (the side-feature slots are the source's, the same for every sample)."""
        def each(value: int) -> np.ndarray:
            return np.full(len(local), value, dtype=np.int64)

        layout = local.side_layout
        sizes = np.stack([local.uih_lengths, local.cand_counts, each(local.labels.shape[1]), each(layout.user_width),
                          each(layout.item_width)], axis=1).astype(np.int64)
        return self.transport.all_gather(torch.from_numpy(sizes))

    def plan(self, global_sizes: np.ndarray, local_count: int) -> "_Plan":
        """Stage II: this rank's view of the partition, and what it sends to and receives from each rank."""
        L, C, K = global_sizes[:, 0], global_sizes[:, 1], global_sizes[:, 2]
        counts = self._slice_counts(len(L), local_count)
        mine = np.arange(int(counts[: self.rank].sum()), int(counts[: self.rank + 1].sum()))
        view = self.view(self.cost_model.cost(L, C), self.world_size, self.rank, mine)
        source = np.repeat(np.arange(self.world_size), counts)
        words = _words(global_sizes)
        send_owner = view.owners
        send_order = np.argsort(send_owner, kind="stable")
        input_splits = np.bincount(send_owner, weights=words[mine], minlength=self.world_size).astype(np.int64)
        recv = view.part  # ascending: global time order
        output_splits = np.bincount(source[recv], weights=words[recv], minlength=self.world_size).astype(np.int64)
        return _Plan(send_order=send_order, send_counts=np.bincount(send_owner, minlength=self.world_size),
                     input_splits=input_splits.tolist(), output_splits=output_splits.tolist(),
                     recv_sizes=global_sizes[recv], recv_sources=source[recv],
                     scale=self._loss_scale(C, recv), num_labels=int(K[0]) if len(K) else 1)

    def exchange(self, local: Samples, plan: "_Plan"):
        """Stage III: issue the all-to-all; ``_Exchange.wait()`` gives this rank's Samples."""
        buffer = _pack(local.select(plan.send_order), plan.send_counts)
        handle = self.transport.all_to_all_single(torch.from_numpy(buffer), plan.input_splits, plan.output_splits)
        return _Exchange(handle, plan, local.side_layout)

    def close(self) -> None:
        """Stop the read-ahead (it finishes the batches every rank starts), then close the
        transport (collectives still in flight fail)."""
        try:
            if self._ahead is not None:
                self._ahead.close()
        finally:
            self.transport.close()

    def rebalance(self, local: Samples) -> tuple[Samples, float]:
        """All three stages, synchronously, on the calling thread: this rank's new samples and
        loss scale (not while ``batches()`` runs: two threads would issue on one group)."""
        if self._ahead is not None:
            raise RuntimeError("balancer: rebalance() while batches() runs on the balancer's thread")
        sizes = self.gather_sizes(local).wait().numpy()
        plan = self.plan(sizes, len(local))
        return self.exchange(local, plan).wait(), plan.scale

    # Read-ahead ----------------------------------------------------------------------------

    def batches(self, local_batches: Iterator[tuple[int, Samples]]) -> CollectiveReadAhead[Batch]:
        """Balanced Batches of the loader's (index, samples), made on the balancer's thread up to
        ``read_ahead`` ahead of the one taken (see the module docstring); ``close()`` stops it."""
        if self._ahead is not None:
            raise RuntimeError("balancer: batches() is already running (one stream per balancer)")

        def next_batch() -> Batch:
            k, local = next(local_batches)  # (StopIteration: the stream ended, and so do the batches)
            return self._balance(k, local)

        self._ahead = CollectiveReadAhead(next_batch, self.read_ahead, abort=self.transport.abort,
                                          name="freescale-balancer")
        return self._ahead

    # Helpers -------------------------------------------------------------------------------

    def _balance(self, k: int, local: Samples) -> Batch:
        """The three stages for global batch ``k``, on the calling thread."""
        with phase("balance"):
            plan = self.plan(self.gather_sizes(local).wait().numpy(), len(local))
            exchange = self.exchange(local, plan)
        return self._finish(k, exchange)

    def _finish(self, k: int, exchange: "_Exchange") -> Batch:
        samples = exchange.wait()
        return Batch.from_samples(samples, k, self.user_hash_size, loss_scale=exchange.plan.scale)

    def _slice_counts(self, total: int, local_count: int) -> np.ndarray:
        """Samples each rank contributed (equal slices from the loader)."""
        if total != local_count * self.world_size:
            raise ValueError(f"balancer: expected {self.world_size} equal local batches of {local_count}, "
                             f"got {total} samples in all")
        return np.full(self.world_size, local_count, dtype=np.int64)

    def _loss_scale(self, C: np.ndarray, recv: np.ndarray) -> float:
        if not self.normalize_loss:
            return 1.0
        return float(self.world_size * C[recv].sum() / C.sum())


@dataclass
class _Plan:
    send_order: np.ndarray  # local samples grouped by destination rank
    send_counts: np.ndarray  # samples to each rank
    input_splits: list[int]  # int64 words to each rank
    output_splits: list[int]  # int64 words from each rank
    recv_sizes: np.ndarray  # (L, C, K) of the samples this rank receives, in global order
    recv_sources: np.ndarray  # source rank of each of them
    scale: float  # loss scale (vbs)
    num_labels: int  # labels per candidate, K (the same for every sample of a run)


class _Exchange:
    def __init__(self, handle, plan: _Plan, side_layout: SideLayout = SideLayout()) -> None:
        self.handle = handle
        self.plan = plan
        self.side_layout = side_layout  # every rank's samples carry the same

    def wait(self) -> Samples:
        buffer = self.handle.wait().numpy()
        parts = []
        offset = 0
        for src, words in enumerate(self.plan.output_splits):
            sizes = self.plan.recv_sizes[self.plan.recv_sources == src]
            parts.append(_unpack(buffer[offset:offset + words], sizes, self.plan.num_labels, self.side_layout))
            offset += words
        return Samples.concat(parts)


def _words(sizes: np.ndarray) -> np.ndarray:
    """Each sample's int64 words in the buffer, from its gathered (L, C, K, user slots, item slots)."""
    L, C, K, user, item = (sizes[:, i] for i in range(5))
    return _META + user + (2 + item) * L + (2 + K + item) * C


def _pack(samples: Samples, counts: np.ndarray) -> np.ndarray:
    """One int64 buffer: per destination, [meta rows, UIH ids, UIH times, candidate ids, candidate
    times, label bits (row-major [candidates, K]), user side slots, history events' item side
    slots, candidates' item side slots (each row-major)].

    ``samples`` are grouped by destination, ``counts[j]`` of them for rank ``j``.
    """
    bounds = np.concatenate([[0], np.cumsum(counts)])
    chunks = [_encode(samples.select(np.arange(bounds[j], bounds[j + 1]))) for j in range(len(counts))]
    return np.concatenate(chunks)


def _encode(s: Samples) -> np.ndarray:
    meta = np.stack([s.sample_ids, s.user_ids, s.uih_lengths, s.cand_counts, s.stream_positions], axis=1).reshape(-1)
    labels = s.labels.astype(np.float64).reshape(-1).view(np.int64)
    return np.concatenate([meta.astype(np.int64), s.uih_values.astype(np.int64), s.uih_timestamps.astype(np.int64),
                           s.cand_values.astype(np.int64), s.cand_timestamps.astype(np.int64), labels,
                           s.user_side.reshape(-1), s.uih_side.reshape(-1), s.cand_side.reshape(-1)])


def _unpack(buffer: np.ndarray, sizes: np.ndarray, num_labels: int, side_layout: SideLayout = SideLayout()) -> Samples:
    """The samples of one source's chunk; ``sizes`` are their gathered (L, C, K, ...), and
    ``num_labels`` is the batch's K (an empty chunk's labels are [0, K] too); ``side_layout``:
    the side features every rank's samples carry."""
    n = len(sizes)
    meta = buffer[: _META * n].reshape(n, _META)
    L, C = meta[:, 2], meta[:, 3]
    if not (np.array_equal(L, sizes[:, 0]) and np.array_equal(C, sizes[:, 1])):
        raise RuntimeError("balancer: received samples do not match the gathered sizes")
    events, cands = int(L.sum()), int(C.sum())
    user_width, item_width = side_layout.user_width, side_layout.item_width
    bounds = np.cumsum([_META * n, events, events, cands, cands, num_labels * cands, n * user_width,
                        events * item_width, cands * item_width])
    if bounds[-1] != len(buffer):
        raise RuntimeError(f"balancer: a chunk of {len(buffer)} words, its samples make {bounds[-1]}")
    uih, uih_times, cand, cand_times, labels, user_side, uih_side, cand_side = (
        buffer[lo:hi].copy() for lo, hi in zip(bounds[:-1], bounds[1:]))
    return Samples(sample_ids=meta[:, 0].copy(), user_ids=meta[:, 1].copy(), uih_lengths=L.copy(), uih_values=uih,
                   uih_timestamps=uih_times, cand_counts=C.copy(), cand_values=cand, cand_timestamps=cand_times,
                   labels=labels.view(np.float64).astype(np.float32).reshape(-1, num_labels),
                   stream_positions=meta[:, 4].copy(), user_side=user_side.reshape(n, user_width),
                   uih_side=uih_side.reshape(events, item_width), cand_side=cand_side.reshape(cands, item_width),
                   side_layout=side_layout)


class NullBalancer:
    """Balancing off: each rank keeps its contiguous slice."""

    def __init__(self, user_hash_size: int) -> None:
        self.user_hash_size = user_hash_size

    def batches(self, local_batches: Iterator[tuple[int, Samples]]) -> Iterator[Batch]:
        for k, samples in local_batches:
            yield Batch.from_samples(samples, k, self.user_hash_size)

    def close(self) -> None:
        pass


def build_balancer(cfg, transport_cfg, cost_model: CostModel, *, group, user_hash_size: int):
    """A Balancer on a gloo group of its own over ``group``'s ranks when ``balance.enable``, else a NullBalancer."""
    if not cfg.enable:
        return NullBalancer(user_hash_size)
    from freescale.distributed import new_group_like
    from freescale.transport.registry import build_transport

    return Balancer(cfg.partition, cost_model, build_transport(transport_cfg, new_group_like(group)),
                    user_hash_size=user_hash_size, normalize_loss=cfg.partition == "vbs", read_ahead=cfg.read_ahead)
