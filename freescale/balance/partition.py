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
  tail sample to also take a large sample from each early round, so a swap pass follows
  (``_refine_by_swaps``): heavy ranks trade samples with light ones, counts unchanged, in
  rounds of disjoint pairs and then one at a time, until within 0.1% of the largest sample's
  bound or until the swaps stop paying;
- ``greedy`` (the default): equal counts, largest sample first to the least loaded rank with
  room left (a rank holding a tail sample then fills up with the smallest ones; above 8192
  samples in blocks of ``ranks / 4``, the block's largest to its least loaded rank), then the
  same swaps. Within 1% of ``equal_count_bound`` in tens of milliseconds at 1024 ranks of 64
  samples, heavy tails included (``scripts/bench_balance.py``);
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
    return _members_to_parts(_refine_by_swaps(costs, _greedy_members(costs, ranks)), len(costs), ranks)


EXACT_GREEDY_UP_TO = 8192
"""Up to this many samples ``greedy`` places them one at a time; above, in blocks."""


def _greedy_members(costs: np.ndarray, ranks: int) -> np.ndarray:
    """[ranks, count] sample indices (-1: padding) of the greedy assignment, before swaps.

    Largest first, each to the least loaded rank that still has room: a rank holding a tail
    sample stays out of the running until the others are full, then takes the smallest. Above
    ``EXACT_GREEDY_UP_TO`` samples, in blocks: the next ``ranks / 4`` samples, largest first, to
    that many least loaded ranks with room, least loaded first.
    """
    n = len(costs)
    left = _equal_counts(n, ranks)
    order = np.argsort(-costs, kind="stable")
    owner = np.empty(n, dtype=np.int64)
    if n <= EXACT_GREEDY_UP_TO:
        room = left.tolist()
        heap = [(0.0, r) for r in range(ranks) if room[r]]
        for i, cost in zip(order.tolist(), costs[order].tolist()):
            load, r = heapq.heappop(heap)
            owner[i] = r
            room[r] -= 1
            if room[r]:
                heapq.heappush(heap, (load + cost, r))
    else:
        block = max(1, ranks // 4)
        loads = np.zeros(ranks)
        start = 0
        while start < n:
            room = np.flatnonzero(left > 0)
            k = min(block, len(room), n - start)
            if k < len(room):
                room = room[np.argpartition(loads[room], k - 1)[:k]]
            pick = room[np.lexsort((room, loads[room]))][:k]  # least loaded first, ties by rank
            took = order[start:start + k]
            owner[took] = pick
            loads[pick] += costs[took]
            left[pick] -= 1
            start += k
    width = int(_equal_counts(n, ranks).max()) if n else 0
    members = np.full((ranks, width), -1, dtype=np.int64)
    for r, x in enumerate(_from_owner(owner, ranks)):
        members[r, : len(x)] = x
    return members


def _members_to_parts(members: np.ndarray, n: int, ranks: int) -> list[np.ndarray]:
    flat = members.ravel()
    rows = np.repeat(np.arange(ranks), members.shape[1])
    owner = np.empty(n, dtype=np.int64)
    owner[flat[flat >= 0]] = rows[flat >= 0]
    return _from_owner(owner, ranks)


def _refine_by_swaps(costs: np.ndarray, members: np.ndarray, tries: int = 8, pairs: int = 64) -> np.ndarray:
    """Swap samples between heavy and light ranks while that lowers the maximum.

    ``members`` is [ranks, rounds] of sample indices (-1 for padding, never moved). Each swap
    moves the pair whose cost difference is closest to half the load gap, so both ranks end
    below the heavier one's old load. Rounds of up to ``pairs`` swaps at once come first (the
    i-th heaviest rank with the i-th lightest, each pair on its own), while more than one
    rank is above the target; then one swap at a time, the heaviest rank with the lightest of
    ``tries`` light ranks that has a pair that helps. The target: within 0.1% of the largest
    sample with the smallest others beside it; the single swaps also stop once 64 of them
    have lowered the maximum by under 0.01% of the mean.
    """
    if members.size == 0 or len(costs) == 0:
        return members
    members = members.copy()
    ranks = members.shape[0]
    values = np.where(members >= 0, costs[np.maximum(members, 0)], np.nan)
    loads = np.nansum(values, axis=1)
    mean = loads.mean()
    tries = min(tries, ranks - 1)
    # (What no equal-count partition beats; ``equal_count_bound`` is tighter, and slower.)
    count = len(costs) // ranks
    smallest = np.partition(costs, count - 1)[:count - 1].sum() if count > 1 else 0.0
    done = (1 + 1e-3) * max(costs.max() + smallest, mean)
    _swap_in_rounds(members, values, loads, min(pairs, ranks // 2), 1e-9 * mean, done,
                    rounds=4 * ranks // max(1, pairs) + 64)
    reference = np.inf
    for step in range(4 * ranks + 64):
        h = int(np.argmax(loads))
        if loads[h] <= done:
            break
        if step % 64 == 0:  # stop once 64 swaps in a row have lowered the maximum by under 0.01%
            if reference - loads[h] < 1e-4 * mean:
                break
            reference = loads[h]
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


def _swap_in_rounds(members: np.ndarray, values: np.ndarray, loads: np.ndarray, pairs: int, tol: float,
                    done: float, rounds: int) -> None:
    """Up to ``pairs`` disjoint swaps per round, in place, until no rank is above ``done``
    (see ``_refine_by_swaps``)."""
    if pairs < 2:
        return
    width = members.shape[1]
    pad = np.isnan(values)
    # A swap (i, j) between heavy h and light l moves d = h's i-th - l's j-th; it helps iff
    # 0 < d < gap, i.e. |d - gap/2| < gap/2: the pair closest to gap/2 helps if any does.
    # Padding as +inf on the heavy side and -inf on the light side is never the closest.
    # Scores in float32 (half the memory traffic); the chosen swap moves its exact float64 cost.
    as_heavy = np.where(pad, np.inf, values).astype(np.float32)
    as_light = np.where(pad, -np.inf, values).astype(np.float32)
    reference = np.inf
    for round_ in range(rounds):
        order = np.argsort(loads, kind="stable")
        count = min(pairs, int((loads > done).sum()))
        if count < 2:  # one heavy rank left (or none): the single swaps take it from here
            break
        if round_ % 4 == 0:  # stop once 4 rounds in a row have cut the load above the target by under 1%
            excess = float(np.maximum(loads - done, 0.0).sum())
            if excess > 0.99 * reference:
                break
            reference = excess
        heavy, light = order[::-1][:count], order[:count]
        half = (loads[heavy] - loads[light]) / 2
        d = as_heavy[heavy][:, :, None] - as_light[light][:, None, :]  # [pair, heavy's sample, light's sample]
        score = np.abs(d - half.astype(np.float32)[:, None, None]).reshape(count, -1)
        best = score.argmin(axis=1)
        i, j = best // width, best % width
        given, taken = values[heavy, i], values[light, j]  # (copies: fancy indexing)
        moved = given - taken
        ok = (moved > 0) & (moved < 2 * half) & (half > tol / 2)  # NaN (padding) fails too
        if ok.sum() < 2:
            break
        h, l, i, j, given, taken, moved = heavy[ok], light[ok], i[ok], j[ok], given[ok], taken[ok], moved[ok]
        members[h, i], members[l, j] = members[l, j], members[h, i]
        for side in (values, as_heavy, as_light):
            side[h, i], side[l, j] = taken, given
        loads[h] -= moved
        loads[l] += moved


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
    """No equal-count partition beats this max rank cost / mean rank cost.

    With ``count`` samples per rank: take the ``t`` largest samples, and say they lie on ``u``
    ranks. Those ranks hold ``u * count`` samples: the ``t`` largest and ``u * count - t``
    others, at least the smallest ones, so the heaviest of them costs at least their total
    over ``u``. Whatever ``u`` is, the max is at least the least of these over ``u``; the
    bound is the largest such value over ``t`` (``t = 1``: the largest sample plus the
    ``count - 1`` smallest others).
    """
    costs = np.sort(np.asarray(costs, dtype=np.float64))
    n = len(costs)
    mean = costs.sum() / ranks if ranks else 0.0
    count = n // ranks if ranks else 0
    if mean <= 0 or count == 0:
        return 1.0
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    top_t = np.arange(1, min(ranks, n) + 1)
    top = prefix[n] - prefix[n - top_t]
    best = 0.0
    for chunk in np.array_split(top_t, max(1, len(top_t) // 128)):  # [t, u] blocks of a bounded size
        t, u = chunk[:, None], top_t[None, :]
        others = u * count - t
        valid = (u <= t) & (others >= 0) & (others <= n - t)
        value = (top[chunk - 1][:, None] + prefix[np.clip(others, 0, n)]) / u
        best = max(best, float(np.where(valid, value, np.inf).min(axis=1).max()))
    return float(max(best, mean) / mean)


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
