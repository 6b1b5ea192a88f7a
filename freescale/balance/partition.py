"""Partition functions: a global batch's per-sample costs -> each rank's sample indices.

Every function is pure and returns, per rank, the indices of its samples in increasing order
(the samples' original time order), each sample exactly once, no rank empty when there are
at least as many samples as ranks. Selected by name from ``PARTITIONS``:

- ``contiguous``: consecutive runs of equal size, what a ``DistributedSampler`` split does
  (the baseline);
- ``zigzag``: sort by cost, deal in snake order (0..n-1, n-1..0, ...): equal counts;
- ``karmarkar_karp``: largest differencing with equal counts: the sorted costs are cut into
  rounds of ``n`` samples, each round a partial partition (one sample per subset), and the
  two partial partitions with the largest spread are merged, heaviest subset of one with the
  lightest of the other, until one remains. One sample per round forces a rank holding a
  tail sample to also take a large sample from each early round, so a swap pass follows:
  while it helps (at most 4 swaps per rank, plus 64), the heaviest rank trades a sample with a
  lighter one, counts unchanged;
- ``greedy``: equal counts, largest sample first to the least loaded rank with room left
  (a rank holding a tail sample then fills up with the smallest ones), then the same swaps;
- ``vbs``: variable batch size: equal cost, unequal counts: largest sample first, each to the
  least loaded rank (the loss is then normalized by the global sample count).
"""

from __future__ import annotations

import heapq
from typing import Callable

import numpy as np


def _check(costs: np.ndarray, ranks: int) -> np.ndarray:
    costs = np.asarray(costs, dtype=np.float64)
    if costs.ndim != 1:
        raise ValueError(f"costs must be 1-D, got shape {costs.shape}")
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    return costs


def _equal_counts(n: int, ranks: int) -> np.ndarray:
    counts = np.full(ranks, n // ranks, dtype=np.int64)
    counts[: n % ranks] += 1
    return counts


def _from_owner(owner: np.ndarray, ranks: int) -> list[np.ndarray]:
    """Per-rank ascending indices from a sample -> rank assignment."""
    order = np.argsort(owner, kind="stable")
    bounds = np.searchsorted(owner[order], np.arange(ranks + 1))
    return [order[bounds[r]:bounds[r + 1]] for r in range(ranks)]


def contiguous(costs, ranks: int) -> list[np.ndarray]:
    costs = _check(costs, ranks)
    bounds = np.concatenate([[0], np.cumsum(_equal_counts(len(costs), ranks))])
    return [np.arange(bounds[r], bounds[r + 1]) for r in range(ranks)]


def zigzag(costs, ranks: int) -> list[np.ndarray]:
    costs = _check(costs, ranks)
    order = np.argsort(-costs, kind="stable")
    pos = np.arange(len(costs))
    rnd, k = pos // ranks, pos % ranks
    owner = np.empty(len(costs), dtype=np.int64)
    owner[order] = np.where(rnd % 2 == 0, k, ranks - 1 - k)
    return _from_owner(owner, ranks)


def karmarkar_karp(costs, ranks: int) -> list[np.ndarray]:
    costs = _check(costs, ranks)
    n = len(costs)
    if n == 0:
        return [np.zeros(0, dtype=np.int64) for _ in range(ranks)]
    rounds = -(-n // ranks)
    # Pad with zero-cost placeholders (index -1) to whole rounds of `ranks` samples.
    order = np.argsort(-costs, kind="stable")
    idx = np.full(rounds * ranks, -1, dtype=np.int64)
    idx[:n] = order
    val = np.zeros(rounds * ranks)
    val[:n] = costs[order]
    # A partial partition: `ranks` subsets, each a (sum, members) pair, sums kept descending.
    heap = []
    for r in range(rounds):
        members = idx[r * ranks:(r + 1) * ranks].reshape(ranks, 1)
        sums = val[r * ranks:(r + 1) * ranks].copy()
        heapq.heappush(heap, (-(sums[0] - sums[-1]), r, sums, members))
    tie = rounds
    while len(heap) > 1:
        _, _, s1, m1 = heapq.heappop(heap)
        _, _, s2, m2 = heapq.heappop(heap)
        sums = s1 + s2[::-1]  # heaviest with lightest
        members = np.concatenate([m1, m2[::-1]], axis=1)
        keep = np.argsort(-sums, kind="stable")
        sums, members = sums[keep], members[keep]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), tie, sums, members))
        tie += 1
    _, _, _, members = heap[0]
    return _members_to_parts(_refine_by_swaps(costs, members), n, ranks)


def greedy(costs, ranks: int) -> list[np.ndarray]:
    costs = _check(costs, ranks)
    n = len(costs)
    left = _equal_counts(n, ranks).tolist()
    order = np.argsort(-costs, kind="stable")
    # Largest first, each to the least loaded rank that still has room: a rank holding a tail
    # sample stays out of the running until the others are full, then takes the smallest.
    slots = [[] for _ in range(ranks)]
    heap = [(0.0, r) for r in range(ranks) if left[r]]
    for i, cost in zip(order.tolist(), costs[order].tolist()):
        load, r = heapq.heappop(heap)
        slots[r].append(i)
        left[r] -= 1
        if left[r]:
            heapq.heappush(heap, (load + cost, r))
    width = max((len(x) for x in slots), default=0)
    members = np.full((ranks, width), -1, dtype=np.int64)
    for r, x in enumerate(slots):
        members[r, : len(x)] = x
    return _members_to_parts(_refine_by_swaps(costs, members), n, ranks)


def _members_to_parts(members: np.ndarray, n: int, ranks: int) -> list[np.ndarray]:
    flat = members.ravel()
    rows = np.repeat(np.arange(ranks), members.shape[1])
    owner = np.empty(n, dtype=np.int64)
    owner[flat[flat >= 0]] = rows[flat >= 0]
    return _from_owner(owner, ranks)


def _refine_by_swaps(costs: np.ndarray, members: np.ndarray, tries: int = 8) -> np.ndarray:
    """Swap samples between the heaviest rank and a light rank while that lowers the maximum.

    ``members`` is [ranks, rounds] of sample indices (-1 for padding, never moved). Each swap
    moves the pair whose cost difference is closest to half the load gap, so both ranks end
    below the old maximum.
    """
    members = members.copy()
    ranks = members.shape[0]
    values = np.where(members >= 0, costs[np.maximum(members, 0)], np.nan)
    loads = np.nansum(values, axis=1)
    mean = loads.mean()
    tries = min(tries, ranks - 1)
    for _ in range(4 * ranks + 64):
        h = int(np.argmax(loads))
        moved = False
        light = np.argpartition(loads, tries)[:tries] if ranks > tries + 1 else np.arange(ranks)
        for l in light[np.argsort(loads[light])]:
            gap = loads[h] - loads[l]
            if gap <= 1e-9 * mean:
                break
            d = values[h][:, None] - values[l][None, :]
            ok = (d > 0) & (d < gap)
            if not ok.any():
                continue
            score = np.where(ok, np.abs(d - gap / 2), np.inf)
            i, j = np.unravel_index(int(np.argmin(score)), score.shape)
            members[h, i], members[l, j] = members[l, j], members[h, i]
            values[h, i], values[l, j] = values[l, j], values[h, i]
            loads[h] -= d[i, j]
            loads[l] += d[i, j]
            moved = True
            break
        if not moved:
            break
    return members


def vbs(costs, ranks: int) -> list[np.ndarray]:
    costs = _check(costs, ranks)
    order = np.argsort(-costs, kind="stable")
    owner = np.empty(len(costs), dtype=np.int64)
    # Longest processing time first: each sample, largest first, to the least loaded rank.
    heap = [(0.0, r) for r in range(ranks)]
    for i, cost in zip(order.tolist(), costs[order].tolist()):
        load, r = heapq.heappop(heap)
        owner[i] = r
        heapq.heappush(heap, (load + cost, r))
    return _from_owner(owner, ranks)


PARTITIONS: dict[str, Callable[[np.ndarray, int], list[np.ndarray]]] = {
    "contiguous": contiguous,
    "zigzag": zigzag,
    "karmarkar_karp": karmarkar_karp,
    "greedy": greedy,
    "vbs": vbs,
}


def imbalance(costs, parts: list[np.ndarray]) -> float:
    """Max rank cost / mean rank cost."""
    loads = np.array([np.asarray(costs, dtype=np.float64)[p].sum() for p in parts])
    return float(loads.max() / loads.mean()) if loads.mean() > 0 else 1.0


def lower_bound(costs, ranks: int) -> float:
    """No partition beats max(largest sample, mean rank cost) / mean rank cost."""
    costs = np.asarray(costs, dtype=np.float64)
    mean = costs.sum() / ranks
    return float(max(costs.max(), mean) / mean) if mean > 0 else 1.0


def equal_count_bound(costs, ranks: int) -> float:
    """With equal counts, the rank holding the largest sample also holds count-1 others:
    no equal-count partition beats (largest + the count-1 smallest others) / mean rank cost."""
    costs = np.sort(np.asarray(costs, dtype=np.float64))
    mean = costs.sum() / ranks
    count = len(costs) // ranks
    if mean <= 0 or count == 0:
        return 1.0
    return float(max(costs[-1] + costs[: count - 1].sum(), mean) / mean)


def evaluate(costs, ranks: int, names: list[str]) -> dict[str, dict]:
    """Quality and speed of each named partition on one global batch's costs."""
    import time

    costs = np.asarray(costs, dtype=np.float64)
    result = {}
    for name in names:
        fn = PARTITIONS[name]
        t0 = time.perf_counter()
        parts = fn(costs, ranks)
        seconds = time.perf_counter() - t0
        loads = np.array([costs[p].sum() for p in parts])
        counts = [len(p) for p in parts]
        result[name] = {
            "imbalance": float(loads.max() / loads.mean()),
            "max_cost": float(loads.max()),
            "mean_cost": float(loads.mean()),
            "seconds": seconds,
            "min_count": int(min(counts)),
            "max_count": int(max(counts)),
            "lower_bound": lower_bound(costs, ranks),
            "equal_count_bound": equal_count_bound(costs, ranks),
        }
    return result
