"""Held-out evaluation of next-item retrieval: leave-one-out, ranked against the whole item table.

Each held-out sample is one user: the history is the latest ``data.max_uih_len`` events before
the user's last one, the target that last item (the sample's first candidate). The model's query
for the user (its last position's output) is scored against every item of the table, and the
target's rank is the number of items that score strictly higher (ties count in the target's
favour), leaving out, with ``task.exclude_history``, the items the user already interacted with
(every one before the target where the source knows the whole timeline, as a ratings log does,
not only those of the history) and always the target itself. From the ranks: HR@K (the share of
targets ranked in the top K), NDCG@K (``1 / log2(rank + 2)`` inside the top K, else 0; one
relevant item, so the ideal DCG is 1), MRR (the mean of ``1 / (rank + 1)``) and MRR@10 (0 past
the top 10).

The table is never gathered in one place. Each rank of the replica takes a contiguous share of
the item ids and computes their item vectors through the same evaluation forward the held-out
samples go through (batches whose candidates are those ids, with their side features from the
source, and whose histories are empty, so every pipeline, TorchRec's tables or FreeScale's,
looks them up its own way); the queries and
the histories are gathered to every rank, each rank scores them against its share, and two
all-reduces add up the target's score (from the rank that holds the target) and the counts.
In one process without a process group (``freescale export``) the share is the whole table and
nothing is reduced; ``freescale serve-bench`` ranks an export's queries and item vectors with the
same ``target_ranks``, so the trained model's figures and the export's are computed alike.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from freescale.data.batch import PADDING, Batch, Samples, SideLayout
from freescale.model.jagged_attention import offsets_of

ITEM_BATCH = 4096
"""Item ids per item-vector batch."""


def rank_metrics(ranks: np.ndarray, ks: list[int]) -> dict:
    """HR@K, NDCG@K for each K, MRR and MRR@10 of 0-based target ranks."""
    ranks = np.asarray(ranks, dtype=np.float64)
    out = {}
    for k in ks:
        hit = ranks < k
        out[f"eval/hr@{k}"] = round(float(hit.mean()), 6)
        out[f"eval/ndcg@{k}"] = round(float(np.where(hit, 1.0 / np.log2(ranks + 2.0), 0.0).mean()), 6)
    out["eval/mrr"] = round(float((1.0 / (ranks + 1.0)).mean()), 6)
    out["eval/mrr@10"] = round(float(np.where(ranks < 10, 1.0 / (ranks + 1.0), 0.0).mean()), 6)
    out["eval/users"] = int(len(ranks))
    return out


def item_batches(num_items: int, rank: int, world_size: int, user_hash_size: int, source=None
                 ) -> tuple[int, list[Batch]]:
    """(first id, batches) of this rank's share of the item ids: one sample per batch with an
    empty history and the ids as candidates, with their side features from ``source`` (its
    ``side_layout`` and ``item_side``; None: none). Every rank makes the same number of batches
    (each forward is a collective); a batch past the end of the table holds item 0 alone."""
    layout = source.side_layout if source is not None else SideLayout()
    per_rank = -(-num_items // world_size)
    lo, hi = min(rank * per_rank, num_items), min((rank + 1) * per_rank, num_items)
    batches = []
    for i, start in enumerate(range(0, per_rank, ITEM_BATCH)):
        ids = np.arange(lo + start, min(lo + start + ITEM_BATCH, hi), dtype=np.int64)
        if not len(ids):
            ids = np.zeros(1, dtype=np.int64)
        samples = Samples(sample_ids=np.zeros(1, dtype=np.int64), user_ids=np.zeros(1, dtype=np.int64),
                          uih_lengths=np.zeros(1, dtype=np.int64), uih_values=np.zeros(0, dtype=np.int64),
                          uih_timestamps=np.zeros(0, dtype=np.int64), cand_counts=np.array([len(ids)]),
                          cand_values=ids, cand_timestamps=np.zeros(len(ids), dtype=np.int64),
                          labels=np.zeros((len(ids), 1), dtype=np.float32),
                          user_side=np.full((1, layout.user_width), PADDING, dtype=np.int64),
                          cand_side=source.item_side(ids) if source is not None else None, side_layout=layout)
        batches.append(Batch.from_samples(samples, i, user_hash_size))
    return lo, batches


def _share(vectors: list[torch.Tensor], lo: int, num_items: int, world_size: int) -> torch.Tensor:
    """This rank's item vectors, without the padding batches' (see ``item_batches``)."""
    per_rank = -(-num_items // world_size)
    count = max(0, min(per_rank, num_items - lo))
    return torch.cat(vectors)[:count].float().cpu()


def held_out_users(batch: Batch) -> tuple[torch.Tensor, np.ndarray, list[np.ndarray]]:
    """(which samples have a history [B] bool, their targets (first candidates), the item ids
    ``exclude_history`` leaves out for each: the user's whole timeline before the target where the
    batch carries it (``Batch.seen_items``), else the history) of a held-out batch: the users
    leave-one-out ranks (one without a history has no query and is left out)."""
    first = offsets_of(batch.cand_counts)[:-1]
    n_uih = int(batch.uih_lengths.sum())
    cand_ids = batch.seq_features.values()[n_uih:]
    uih_ids = batch.seq_features.values()[:n_uih].numpy()
    has = batch.uih_lengths > 0
    if batch.seen_items is not None:  # the user's whole timeline before the target
        return has, cand_ids[first][has].numpy(), [s for s, h in zip(batch.seen_items, has.tolist()) if h]
    bounds = offsets_of(batch.uih_lengths).numpy()
    histories = [uih_ids[a:b] for a, b, h in zip(bounds[:-1], bounds[1:], has.tolist()) if h]
    return has, cand_ids[first][has].numpy(), histories


def _no_reduce(tensor: torch.Tensor) -> None:
    """One process holds the whole table: its partial sums are the totals."""


def target_ranks(queries: torch.Tensor, share: torch.Tensor, lo: int, targets: np.ndarray,
                 histories: list[np.ndarray], exclude_history: bool, all_reduce=_no_reduce) -> np.ndarray:
    """0-based rank of each target among the whole table's items: how many score strictly above
    it (``queries`` [Q, D] against the item vectors), the target itself and, with
    ``exclude_history``, the user's history left out. ``share`` [n, D] holds the vectors of ids
    ``[lo, lo + n)``; ``all_reduce`` sums a tensor over the processes that hold the other shares
    (in place; a no-op when ``share`` is the whole table, as in ``freescale export``)."""
    scores = queries @ share.T  # [queries, share]
    n = share.shape[0]
    owned = (targets >= lo) & (targets < lo + n)
    target_score = torch.zeros(len(targets), dtype=torch.float32)
    rows = torch.from_numpy(np.flatnonzero(owned))
    target_score[rows] = scores[rows, torch.from_numpy(targets[owned] - lo)]
    all_reduce(target_score)  # only the owner adds a non-zero
    above = scores > target_score[:, None]
    left_out = torch.zeros_like(above)
    left_out[rows, torch.from_numpy(targets[owned] - lo)] = True
    if exclude_history:
        for i, h in enumerate(histories):
            local = h[(h >= lo) & (h < lo + n)] - lo
            left_out[i, torch.from_numpy(local)] = True
    counts = (above & ~left_out).sum(dim=1).to(torch.int64)
    all_reduce(counts)
    return counts.numpy()


def evaluate_retrieval(model, held_out: list[Batch], *, num_items: int, ks: list[int], exclude_history: bool,
                       group: dist.ProcessGroup | None, user_hash_size: int, source=None) -> dict:
    """The metrics above over every rank's held-out samples; ``model(batch) -> (loss, StepOutput)``
    is the pipeline's evaluation forward (a collective: every rank calls this together).
    ``group=None``: one process without a process group holds the model whole (``freescale
    export``). ``source``: where the items' side features come from (None: no side features)."""
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    lo, batches = item_batches(num_items, rank, world, user_hash_size, source)
    share = _share([model(b)[1].items for b in batches], lo, num_items, world)  # [n_share, D]

    queries, targets, histories = [], [], []
    for batch in held_out:
        out = model(batch)[1]
        has, target, history = held_out_users(batch)
        queries.append(out.queries.float().cpu()[has])
        targets.append(target)
        histories += history
    dim = share.shape[1] if share.numel() else (queries[0].shape[1] if queries else 1)
    mine = (torch.cat(queries) if queries else torch.zeros((0, dim)), np.concatenate(targets) if targets else
            np.zeros(0, dtype=np.int64), histories)
    gathered: list = [None] * world
    if group is not None:
        dist.all_gather_object(gathered, mine, group=group)
    else:
        gathered = [mine]
    q = torch.cat([g[0] for g in gathered])
    target = np.concatenate([g[1] for g in gathered]).astype(np.int64)
    history = [h for g in gathered for h in g[2]]
    if not len(target):
        return {}
    reduce = (lambda t: dist.all_reduce(t, group=group)) if group is not None else _no_reduce
    return rank_metrics(target_ranks(q, share, lo, target, history, exclude_history, reduce), ks)


def retrieval_line(result: dict, ks: list[int]) -> str:
    k = 10 if 10 in ks else ks[0]
    return (f"eval hr@{k} {result[f'eval/hr@{k}']:.4f} | ndcg@{k} {result[f'eval/ndcg@{k}']:.4f} | "
            f"mrr {result['eval/mrr']:.4f} over {result['eval/users']} users")

