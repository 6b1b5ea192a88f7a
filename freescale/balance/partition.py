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
  least loaded rank (the loss is then normalized by the global sample count);
- ``hierarchical``: for 8K-100K ranks (0.5M-6.4M samples a global batch), where ``greedy``
  over the whole batch, on every rank every step, costs too much: hosts first, then the
  ranks of each host. A host is ``ranks_per_host`` consecutive ranks (``RANKS_PER_HOST``, 8,
  under the name; the last host has the rest when ``ranks`` is not a multiple). The host
  split sorts the costs once; the largest samples that stay above the other ranks' level
  even beside the smallest ones (``_anchor_count``) are anchors, one to a rank, spread over
  the hosts in snake order, and the smallest samples are set aside for their ranks; the rest
  are dealt in rounds of one sample per host (a host with fewer ranks free of anchors takes
  part in fewer rounds, spread evenly), the first ``LPT_ROUNDS`` by load (the round's largest
  to the least loaded host per free rank), the others in snake order. Within each host,
  ``greedy``'s rule without its swaps (largest first to the least loaded rank with room; with
  one host it is ``greedy``'s exact assignment), every host at once. Equal counts, the same
  per rank as ``greedy``. Within 0.7% of the equal-count bound on the benchmark's lengths at
  8K, 32K and 100K ranks of 64 samples, under a second for 100K ranks' whole batch, one
  rank's own part in under half a second (``scripts/bench_balance.py``, section (c)).
  What makes it scale: the host split is cheap and the same on every rank, and a rank needs
  only a few hosts' within-host solves, not all of them: ``hierarchical_host`` (one host's
  ranks) and ``hierarchical_rank`` (one rank) give the same parts as the whole solve at
  less than half its time at 100K ranks (the sort of the costs is most of what remains),
  and ``host_split`` each sample's host, what a rank needs to send its samples through the
  hosts first. With one all-to-all straight to the ranks, as the balancer sends, a sender
  also needs the ranks its own samples go to: ``hierarchical_view`` looks up those samples'
  hosts and solves them beside its own (at most ``batch_size + 1`` hosts of 12,500 at 100K
  ranks).

What a rank runs: ``RANK_VIEWS`` gives, per name, ``(costs, ranks, rank, asked) -> RankView``,
the rank's own part and the ranks of the samples it sends, the same as the whole partition
gives them. Only ``hierarchical`` is split (``hierarchical_view``). The others are the whole
partition on every rank (``whole_view``): ``contiguous`` has nothing to solve, ``zigzag``'s one
sort is its whole cost, and ``greedy``, ``karmarkar_karp`` and ``vbs`` place every sample by
the loads of every rank (and swap between any two), so no rank's part is known before all are.
"""

from __future__ import annotations

import heapq
from functools import cached_property
from typing import Callable, NamedTuple

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


class RankView(NamedTuple):
    """What one rank needs of a global batch's partition to exchange its samples."""

    part: np.ndarray
    """The rank's own samples, ascending: ``parts[rank]`` of the whole partition."""
    owners: np.ndarray
    """The rank each of the samples asked about goes to (the rank's own, to send them)."""


def _from_owner(owner: np.ndarray, ranks: int) -> list[np.ndarray]:
    """Per-rank ascending indices from a sample -> rank assignment."""
    order = np.argsort(owner, kind="stable")
    bounds = np.searchsorted(owner[order], np.arange(ranks + 1))
    return [order[bounds[r]:bounds[r + 1]] for r in range(ranks)]


def contiguous(costs, ranks: int) -> list[np.ndarray]:
    """Consecutive runs of equal size. Not split per rank: it is closed form, there is nothing to solve."""
    costs = _check(costs, ranks)
    bounds = np.concatenate([[0], np.cumsum(_equal_counts(len(costs), ranks))])
    return [np.arange(bounds[r], bounds[r + 1]) for r in range(ranks)]


def zigzag(costs, ranks: int) -> list[np.ndarray]:
    """Snake order over the costs sorted once. Not split per rank: that sort is its whole cost."""
    costs = _check(costs, ranks)
    order = np.argsort(-costs, kind="stable")
    pos = np.arange(len(costs))
    rnd, k = pos // ranks, pos % ranks
    owner = np.empty(len(costs), dtype=np.int64)
    owner[order] = np.where(rnd % 2 == 0, k, ranks - 1 - k)
    return _from_owner(owner, ranks)


def karmarkar_karp(costs, ranks: int) -> list[np.ndarray]:
    """Largest differencing, then swaps. Cannot be split per rank: every merge pairs subsets by
    their sums over all ranks, and the swaps pair any two ranks."""
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
    """Largest first to the least loaded rank with room, then swaps. Cannot be split per rank:
    each sample's rank depends on the loads of all ranks, and the swaps pair any two ranks."""
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
    """Largest first to the least loaded rank, unequal counts. Cannot be split per rank: each
    sample's rank depends on the loads of all ranks."""
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


RANKS_PER_HOST = 8
"""``hierarchical``'s default host size: ranks per host."""

LPT_ROUNDS = 64
"""``hierarchical``'s host split re-sorts the hosts by load for this many rounds, then deals in snake order."""

ANCHOR_SHARE = 0.5
"""``hierarchical``: samples of at least this share of the other ranks' level get a rank of their own."""

_KEY_MAX = np.int64(np.iinfo(np.int64).max)


def hierarchical(costs, ranks: int, ranks_per_host: int = RANKS_PER_HOST) -> list[np.ndarray]:
    """Every rank's part: hosts first, then each host's ranks (see the module docstring).

    Hosts are consecutive blocks of ``ranks_per_host`` ranks (rank ``r`` on host
    ``r // ranks_per_host``); where ``ranks`` is not a multiple of it, the last host has the
    remaining ranks (its share of the samples scaled to match). Rank ``r`` gets exactly as many
    samples as from ``greedy``. Costs must be finite and non-negative.
    """
    plan = _HostPlan(costs, ranks, ranks_per_host)
    members = plan.members(np.arange(plan.hosts))[:ranks]
    return _rows_to_parts(members, plan.counts)


def hierarchical_host(costs, ranks: int, host: int, ranks_per_host: int = RANKS_PER_HOST) -> list[np.ndarray]:
    """Only ``host``'s ranks' parts, the same arrays as ``hierarchical(...)`` gives them.

    ``host``'s ranks are ``host * ranks_per_host`` onwards (``ranks_per_host`` of them, fewer on
    the last host). The host split runs in full (identical on every rank, no within-host
    solve); the within-host solve, the bulk of ``hierarchical``'s time at 8K-100K ranks, for
    ``host`` alone.
    """
    plan = _HostPlan(costs, ranks, ranks_per_host)
    if isinstance(host, bool) or not isinstance(host, (int, np.integer)) or not 0 <= host < plan.hosts:
        raise ValueError(f"hierarchical_host: host must be an integer in [0, {plan.hosts}) "
                         f"({ranks} ranks, {plan.per_host} per host), got {host!r}")
    first = int(host) * plan.per_host
    count = int(plan.host_ranks[host])
    return _rows_to_parts(plan.members(np.array([host]))[:count], plan.counts[first:first + count])


def hierarchical_rank(costs, ranks: int, rank: int, ranks_per_host: int = RANKS_PER_HOST) -> np.ndarray:
    """Only ``rank``'s part (its host's solve): ``hierarchical(...)[rank]``."""
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < ranks:
        raise ValueError(f"hierarchical_rank: rank must be an integer in [0, {ranks}), got {rank!r}")
    per_host = _check_per_host(ranks_per_host)
    return hierarchical_host(costs, ranks, int(rank) // per_host, per_host)[int(rank) % per_host]


def hierarchical_view(costs, ranks: int, rank: int, asked, ranks_per_host: int = RANKS_PER_HOST) -> RankView:
    """``rank``'s part and the owners of ``asked`` (the samples ``rank`` sends), the same as
    ``hierarchical(...)`` gives them: the host split, then the within-host solves of only the
    hosts involved, ``rank``'s own and those ``asked`` are dealt to (at most ``len(asked) + 1``
    of them; each sample's host is looked up, not computed for the whole batch)."""
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < ranks:
        raise ValueError(f"hierarchical_view: rank must be an integer in [0, {ranks}), got {rank!r}")
    plan = _HostPlan(costs, ranks, ranks_per_host)
    asked = np.asarray(asked, dtype=np.int64).reshape(-1)
    if len(asked) and not 0 <= asked.min() <= asked.max() < plan.n:
        raise ValueError(f"hierarchical_view: asked samples must be indices in [0, {plan.n})")
    P, own = plan.per_host, int(rank) // plan.per_host
    hosts = np.union1d([own], plan.hosts_of(plan.positions(asked)))
    members = plan.members(hosts)  # [host, rank of the host] rows, host-major
    mine = np.sort(members[np.searchsorted(hosts, own) * P + int(rank) % P])[:plan.counts[rank]].astype(np.int64)
    rows = np.broadcast_to((hosts[:, None] * P + np.arange(P)[None, :]).reshape(-1, 1), members.shape)
    placed = members < plan.n
    samples, owner = members[placed].astype(np.int64), rows[placed]
    by_sample = np.argsort(samples, kind="stable")
    return RankView(part=mine, owners=owner[by_sample[np.searchsorted(samples[by_sample], asked)]])


def host_split(costs, ranks: int, ranks_per_host: int = RANKS_PER_HOST) -> np.ndarray:
    """Each sample's host under ``hierarchical`` (no within-host solve): what a sender needs to
    route its samples to their hosts when the exchange goes through hosts first."""
    return _HostPlan(costs, ranks, ranks_per_host).host_of()


def _check_per_host(ranks_per_host) -> int:
    if isinstance(ranks_per_host, bool) or not isinstance(ranks_per_host, (int, np.integer)) or ranks_per_host < 1:
        raise ValueError(f"hierarchical: ranks_per_host must be a positive integer (ranks per host), "
                         f"got {ranks_per_host!r}")
    return int(ranks_per_host)


def _rows_to_parts(members: np.ndarray, counts: np.ndarray) -> list[np.ndarray]:
    """Rows of sample indices (padded with n after each row's count) -> ascending parts."""
    members.sort(axis=1)
    members = members.astype(np.int64, copy=False)
    if len(counts) and (counts == members.shape[1]).all():
        return list(members)
    return [row[:c] for row, c in zip(members, counts.tolist())]


def _descending(costs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sample indices by decreasing cost (ties: increasing index), and their costs, each with
    one more entry at the end (index -1, cost 0: "no sample", what position -1 reads).

    One sort of 64-bit keys (the cost's bits above, the index below, reversed) instead of an
    argsort: the keys are distinct, so any sort gives the same result; sorted as floats (the
    same order: a finite non-negative cost's bits begin with a valid float's, and such floats
    order as their bits do), which numpy sorts faster than integers, then read backwards. The
    cost keeps its upper ``64 - log2(n)`` bits (29 of the 52 mantissa bits at 6.4M samples):
    costs that agree to that precision count as equal, and the costs returned are the kept
    bits. ``costs`` are finite and non-negative, without -0.0.
    """
    n = len(costs)
    order, value = np.empty(n + 1, dtype=np.int64), np.empty(n + 1, dtype=np.int64)
    order[n], value[n] = -1, 0
    bits = max(1, (n - 1).bit_length())
    if bits > 40:
        order[:n] = np.argsort(-costs, kind="stable")
        value[:n] = costs[order[:n]].view(np.int64)
        return order, value.view(np.float64)
    low = np.int64((1 << bits) - 1)
    key = np.bitwise_and(costs.view(np.int64), ~low)
    key |= np.arange(n - 1, -1, -1, dtype=np.int64)  # ascending key: ascending cost, then decreasing index
    key.view(np.float64).sort()
    backwards = key[::-1]
    np.bitwise_and(backwards, low, out=order[:n])
    np.subtract(n - 1, order[:n], out=order[:n])
    np.bitwise_and(backwards, ~low, out=value[:n])
    return order, value.view(np.float64)


def _anchor_level(y: np.ndarray, ranks: int, count: int) -> tuple[int, float]:
    """How many of the largest samples stay above the other ranks beside the smallest ones,
    and the level those other ranks then share (``y``: ``_descending``'s costs).

    With the ``s`` largest samples each on its own rank beside ``count - 1`` of the smallest
    ones, the other ranks share the rest at ``level(s)`` each; the ``s``-th largest qualifies if
    it and an average share of those smallest ones reach that level. The count of leading
    samples that qualify (looked at 1024, 2048, 4096, ... at a time: it is mostly small),
    and its level.
    """
    total = float(y[:-1].sum())
    most = ranks - 1
    if count < 2 or most < 1:
        return 0, total / ranks
    reverse = y[-2::-1]
    upto = min(most, 1024)
    while True:
        s = np.arange(1, upto + 1)
        top = np.cumsum(y[:upto])
        smallest = np.concatenate([[0.0], np.cumsum(reverse[: upto * (count - 1)])])[s * (count - 1)]
        level = (total - top - smallest) / (ranks - s)
        qualifies = y[:upto] + smallest / s >= level
        if not qualifies.all() or upto == most:
            k = int(np.argmin(qualifies)) if not qualifies.all() else most
            return k, (float(level[k - 1]) if k else total / ranks)
        upto = min(most, 2 * upto)


class _HostPlan:
    """The host split of one global batch (see the module docstring), and within-host solves.

    Positions are into ``order`` / ``y`` (``_descending``'s: decreasing cost; position ``n``
    reads "no sample"). Anchors, the largest samples, take a rank each (slot ``j`` of every
    host in turn, snake order), with their companions fixed here: the smallest samples for
    the saturated ones (which stay above the other ranks' level whatever they are given),
    dealt over them largest first to the least loaded; for the others, a run of consecutive
    samples (a window) that brings the anchor up to at most that level. The rest, the middle,
    is dealt over the hosts in proportion to their ranks without an anchor (``_Deal``), and
    within each host over those ranks (``_within_hosts``).
    """

    def __init__(self, costs, ranks: int, ranks_per_host: int) -> None:
        costs = np.ascontiguousarray(_check(costs, ranks))
        self.per_host = P = _check_per_host(ranks_per_host)
        self.n = n = len(costs)
        bits = costs.view(np.int64)  # finite non-negative floats: 0 <= bits < those of inf
        if n and bits.min() < 0:
            costs = costs + 0.0  # -0.0 -> 0.0; the negative ones stay negative
            bits = costs.view(np.int64)
        if n and not 0 <= bits.min() <= bits.max() < np.float64(np.inf).view(np.int64):
            raise ValueError("hierarchical: costs must be finite and non-negative")
        self.hosts = H = -(-ranks // P)
        self.host_ranks = np.minimum(P, ranks - P * np.arange(H))
        self.counts = _equal_counts(n, ranks)
        cnt = np.zeros(H * P, dtype=np.int64)
        cnt[:ranks] = self.counts
        self.cnt = cnt = cnt.reshape(H, P)  # samples per (host, rank of the host); 0 beyond the last rank
        self.costs = costs
        self.order, self.y = _descending(costs)
        y = self.y
        count = n // ranks
        saturated, level = _anchor_level(y, ranks, count)
        anchors = saturated
        if count >= 2:
            anchors += int(np.count_nonzero(y[saturated:min(n, ranks - 1)] >= ANCHOR_SHARE * level))
        slots = [np.flatnonzero(self.host_ranks > j) for j in range(P)]
        slot_host = np.concatenate([s[::-1] if j % 2 else s for j, s in enumerate(slots)])
        slot_rank = np.concatenate([np.full(len(s), j, dtype=np.int64) for j, s in enumerate(slots)])
        room = cnt[slot_host, slot_rank] - 1  # companions of an anchor on that slot
        reserved = int(room[:saturated].sum())  # the saturated anchors' companions: the smallest samples
        window = np.zeros(0, dtype=np.int64)
        if anchors > saturated:
            # Windows in ascending position (0: the smallest sample) above the reserved ones:
            # each the highest whose total is at most level - anchor, each above the one before.
            ascending = np.concatenate([[0.0], np.cumsum(y[n - 1::-1])])
            size = room[saturated:anchors]
            target = level - y[saturated:anchors]
            start = np.empty(len(size), dtype=np.int64)
            for w in np.unique(size).tolist():
                sums = ascending[reserved + w:] - ascending[reserved:n + 1 - w]
                pick = size == w
                start[pick] = reserved + np.maximum(np.searchsorted(sums, target[pick], side="right") - 1, 0)
            before = np.concatenate([[0], np.cumsum(size)[:-1]])
            start = before + np.maximum.accumulate(start - before)
            fits = int(np.count_nonzero(start + size <= n - anchors))  # a prefix: start + size increases
            # A window pushed up past the ones below it can overshoot the level (many equal
            # anchors, ties at a length cap): the anchors from there on go to the middle.
            over = ascending[start[:fits] + size[:fits]] - ascending[start[:fits]] > target[:fits]
            fits = int(np.argmax(over)) if over.any() else fits
            anchors = saturated + fits
            window = start[:fits]
        self.anchors, self.saturated, self.reserved, self.window = anchors, saturated, reserved, window
        self.anchor_host, self.anchor_rank, self.anchor_room = slot_host[:anchors], slot_rank[:anchors], room[:anchors]
        # The middle: every position not an anchor's or a companion's.
        edge = np.zeros(n + 1, dtype=np.int64)
        edge[0] += 1
        edge[anchors] -= 1
        edge[n - reserved] += 1
        edge[n] -= 1
        top = n - window - self.anchor_room[saturated:]  # a window's descending positions: [top, top + size)
        np.add.at(edge, top, 1)
        np.add.at(edge, top + self.anchor_room[saturated:], -1)
        self.middle = np.append(np.flatnonzero(np.cumsum(edge[:n]) == 0), n)  # (n: -1 reads "no sample")
        self.free = cnt.copy()
        self.free[self.anchor_host, self.anchor_rank] = 0
        self.free_ranks = self.host_ranks - np.bincount(self.anchor_host, minlength=H)

    @cached_property
    def middle_deal(self) -> "_Deal":
        """The middle over the hosts, in proportion to their ranks without an anchor."""
        return _Deal(self.y[self.middle[:-1]], self.free.sum(axis=1), np.maximum(self.free_ranks, 1),
                     np.zeros(self.hosts))

    @cached_property
    def companion_deal(self) -> "_Deal":
        """The smallest samples over the saturated anchors (each anchor a "host" of the deal)."""
        saturated = self.saturated
        return _Deal(self.y[self.n - self.reserved:self.n], self.anchor_room[:saturated], np.ones(saturated),
                     self.y[:saturated].copy())

    def middle_blocks(self, hosts: np.ndarray) -> np.ndarray:
        """The middle's positions [slots, len(hosts)], decreasing cost down a column; n: none."""
        return self.middle[self.middle_deal.blocks(hosts, 0)]

    def anchor_rows(self, hosts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The anchors on ``hosts``: (their index into ``hosts``, their rank of the host, their
        positions [anchor, companions...] padded with n)."""
        saturated = self.saturated
        where = np.full(self.hosts, -1, dtype=np.int64)
        where[hosts] = np.arange(len(hosts))
        mine = np.flatnonzero(where[self.anchor_host] >= 0)
        rows = np.full((len(mine), int(self.anchor_room.max(initial=0)) + 1), self.n, dtype=np.int64)
        rows[:, 0] = mine
        sat = mine[mine < saturated]
        if len(sat):
            comp = self.companion_deal.blocks(sat, self.n - self.reserved)
            rows[:len(sat), 1:comp.shape[0] + 1] = np.where(comp >= 0, comp, self.n).T
        big = mine[mine >= saturated]
        if len(big):
            size = self.anchor_room[big]
            top = self.n - self.window[big - saturated] - size
            k = np.arange(rows.shape[1] - 1)[None, :]
            rows[len(sat):, 1:] = np.where(k < size[:, None], top[:, None] + k, self.n)
        return where[self.anchor_host[mine]], self.anchor_rank[mine], rows

    def members(self, hosts: np.ndarray) -> np.ndarray:
        """[len(hosts) * per_host, width] sample indices of those hosts' ranks (host-major),
        unsorted, padded with n: the within-host solve."""
        width = int(self.cnt.max()) if self.cnt.size else 0
        members = _within_hosts(self.middle_blocks(hosts), self.order, self.y, self.free[hosts], width)
        at, rank, rows = self.anchor_rows(hosts)
        if len(at):
            members[at * self.per_host + rank, :rows.shape[1]] = np.where(rows < self.n, self.order[rows], self.n)
        return members

    def host_of(self) -> np.ndarray:
        """Each sample's host."""
        host = np.empty(self.n, dtype=np.int64)
        every = np.arange(self.hosts)
        pos = self.middle_blocks(every)
        valid = pos < self.n
        host[self.order[pos[valid]]] = np.broadcast_to(every, pos.shape)[valid]
        at, _, rows = self.anchor_rows(every)
        valid = rows < self.n
        host[self.order[rows[valid]]] = np.broadcast_to(at[:, None], rows.shape)[valid]
        return host

    def positions(self, samples: np.ndarray) -> np.ndarray:
        """Where each of ``samples`` sits in ``order``: bisections of ``y`` for its cost (as
        ``_descending`` kept it), then of its run of equal costs (increasing indices) for it."""
        n = self.n
        value = self.costs[samples]
        bits = max(1, (n - 1).bit_length())
        if bits <= 40:
            value = (value.view(np.int64) & ~np.int64((1 << bits) - 1)).view(np.float64)
        first = _count_descending(self.y[:n], value, strictly=True)  # costs above it
        end = _count_descending(self.y[:n], value, strictly=False)  # costs at least it
        return np.array([lo + int(np.searchsorted(self.order[lo:hi], s)) for s, lo, hi in
                         zip(samples.tolist(), first.tolist(), end.tolist())], dtype=np.int64)

    def hosts_of(self, positions: np.ndarray) -> np.ndarray:
        """The host of each of ``positions``: an anchor's own, a companion's anchor's, or where
        the middle's deal put it (what ``host_of`` gives, for a few samples)."""
        n, saturated, anchors = self.n, self.saturated, self.anchors
        host = np.full(len(positions), -1, dtype=np.int64)
        anchor = positions < anchors
        host[anchor] = self.anchor_host[positions[anchor]]
        reserved = ~anchor & (positions >= n - self.reserved)
        if reserved.any():
            host[reserved] = self.anchor_host[self.companion_deal.hosts_at(positions[reserved] - (n - self.reserved))]
        size = self.anchor_room[saturated:anchors]
        if (size > 0).any():  # the windows, [top, top + size) each: disjoint
            top = n - self.window - size
            by_top = np.flatnonzero(size > 0)
            by_top = by_top[np.argsort(top[by_top], kind="stable")]
            j = by_top[np.maximum(np.searchsorted(top[by_top], positions, side="right") - 1, 0)]
            inside = (host < 0) & ~reserved & (top[j] <= positions) & (positions < top[j] + size[j])
            host[inside] = self.anchor_host[saturated + j[inside]]
        rest = np.flatnonzero(host < 0)
        if len(rest):
            at = np.searchsorted(self.middle, positions[rest])
            if not np.array_equal(self.middle[at], positions[rest]):
                raise AssertionError("hierarchical: a position is neither an anchor's, a companion's nor the middle's")
            host[rest] = self.middle_deal.hosts_at(at)
        return host


class _Deal:
    """A deal of ``values`` (decreasing costs) over hosts: ``blocks`` gives hosts' positions,
    ``hosts_at`` the hosts of given positions.

    Each host takes ``capacity`` samples, spread evenly over ``max(capacity)`` rounds (a host
    with a full capacity takes one in every round). Rounds deal consecutive samples: the
    first ``LPT_ROUNDS`` by load per ``weight`` (the largest of the round to the least loaded
    host, re-sorted after every round; ``load`` to start from), the rest in snake order over
    the last order (forwards, backwards, ...), which a host can compute for itself. The
    load-ordered rounds are replayed once, when the deal is made, and kept for both questions.
    """

    def __init__(self, values: np.ndarray, capacity: np.ndarray, weight: np.ndarray, load: np.ndarray) -> None:
        self.hosts = H = len(capacity)
        self.rounds = T = int(capacity.max()) if H else 0
        if T == 0:
            return
        self.active = active = np.flatnonzero(capacity > 0)
        caps, self.group = np.unique(capacity[active], return_inverse=True)
        self.groups = G = len(caps)
        self.share = share = np.arange(T + 1)[None, :] * caps[:, None] // T  # [group, round]: samples taken before the round
        self.takes = takes = share[:, 1:] > share[:, :-1]
        self.per_round = per_round = np.bincount(self.group, minlength=G) @ takes
        self.start = start = np.concatenate([[0], np.cumsum(per_round)])
        self.head = head = min(LPT_ROUNDS, T)
        inv_weight = 1.0 / weight[active]
        norm = load[active] * inv_weight
        order = np.argsort(norm, kind="stable")
        self.head_order = []  # per load-ordered round: its participants (into ``active``), least loaded first
        for t in range(head):
            p = self._taking(order, t)
            self.head_order.append(p)
            norm[p] += values[start[t]:start[t + 1]] * inv_weight[p]
            order = order[np.argsort(norm[order], kind="stable")]
        self.order = order  # the order the snake rounds go by

    def _taking(self, order: np.ndarray, t: int) -> np.ndarray:
        """The hosts of ``order`` (indices into ``active``) that take a sample in round ``t``."""
        return order if self.groups == 1 else order[self.takes[self.group[order], t]]

    def blocks(self, hosts: np.ndarray, offset: int) -> np.ndarray:
        """Positions (``offset`` + index into ``values``) per host: [slots, len(hosts)], -1 pads."""
        T, H = self.rounds, self.hosts
        out = np.full((T, len(hosts)), -1, dtype=np.int64)
        if T == 0:
            return out
        G = self.groups
        active, group, share, takes, start, head = self.active, self.group, self.share, self.takes, self.start, self.head
        per_round, order = self.per_round, self.order
        whole = len(hosts) == H  # (then hosts is every host, in order)
        if whole:
            for t in range(T):
                if t < head:
                    p = self.head_order[t]
                else:  # the snake rounds
                    p = self._taking(order, t)
                    p = p if (t - head) % 2 == 0 else p[::-1]
                out[t if G == 1 else share[group[p], t], active[p]] = np.arange(offset + start[t], offset + start[t + 1])
            return out
        head_pos = np.full((head, len(active)), -1, dtype=np.int64)
        for t, p in enumerate(self.head_order):
            head_pos[t, p] = np.arange(start[t], start[t + 1])
        # Some hosts (a host's own solve): the snake rounds in closed form, per round the host's place.
        index = np.full(H, -1, dtype=np.int64)
        index[active] = np.arange(len(active))
        which = index[hosts]
        keep = np.flatnonzero(which >= 0)
        which = which[keep]
        place = np.empty(len(active), dtype=np.int64)
        place[order] = np.arange(len(active))
        tail = np.arange(head, T)
        if G == 1:
            ahead = np.broadcast_to(place[which], (len(tail), len(which)))
        else:  # participants ahead in the order, per round: per group, those ahead times whether the group takes
            ahead_by_group = np.zeros((G, len(active) + 1))
            ahead_by_group[:, 1:] = np.cumsum(group[order][None, :] == np.arange(G)[:, None], axis=1)
            ahead = (takes[:, head:].T.astype(np.float64) @ ahead_by_group[:, place[which]]).astype(np.int64)
        forward = ((tail - head) % 2 == 0)[:, None]
        tail_pos = start[head:T][:, None] + np.where(forward, ahead, per_round[head:][:, None] - 1 - ahead)
        if G > 1:
            tail_pos = np.where(takes[group[which]][:, head:].T, tail_pos, -1)
        by_round = np.concatenate([head_pos[:, which], tail_pos])
        taken = by_round >= 0
        by_round[taken] += offset
        if G == 1:
            out[:, keep] = by_round
            return out
        slot = share[group[which], :T].T  # a host's t-th round fills its slot share(t)
        column = np.broadcast_to(keep, by_round.shape)
        out[slot[taken], column[taken]] = by_round[taken]
        return out

    def hosts_at(self, positions: np.ndarray) -> np.ndarray:
        """The host each of ``positions`` (indices into ``values``) is dealt to."""
        positions = np.asarray(positions, dtype=np.int64)
        out = np.empty(len(positions), dtype=np.int64)
        if len(positions) == 0:
            return out
        rounds = np.searchsorted(self.start, positions, side="right") - 1
        for t in np.unique(rounds).tolist():
            if t < self.head:
                p = self.head_order[t]
            else:
                p = self._taking(self.order, t)
                p = p if (t - self.head) % 2 == 0 else p[::-1]
            at = rounds == t
            out[at] = self.active[p[positions[at] - self.start[t]]]
        return out


def _count_descending(y: np.ndarray, values: np.ndarray, strictly: bool) -> np.ndarray:
    """Per value, how many entries of the non-increasing ``y`` are above it (``strictly``) or at
    least it: ``searchsorted`` for a descending array, by bisection (no reversed copy of ``y``)."""
    lo = np.zeros(len(values), dtype=np.int64)
    hi = np.full(len(values), len(y), dtype=np.int64)
    while (searching := lo < hi).any():
        mid = (lo + hi) // 2
        entry = y[np.minimum(mid, len(y) - 1)]
        ahead = entry > values if strictly else entry >= values
        lo = np.where(searching & ahead, mid + 1, lo)
        hi = np.where(searching & ~ahead, mid, hi)
    return lo


def _within_hosts(block: np.ndarray, order: np.ndarray, y: np.ndarray, cnt: np.ndarray, width: int) -> np.ndarray:
    """``greedy``'s rule within each host, every host at once: samples in decreasing cost,
    each to the least loaded rank of its host with room left (ties: the lower rank).

    ``blocks``: positions into ``order`` / ``y`` (``_descending``'s) per [slot, host], in
    decreasing cost down a column; ``cnt``: [hosts, per_host] samples per rank. Returns
    [hosts * per_host, max(cnt)] sample indices (host-major, unsorted), padded with n.
    """
    H, P = cnt.shape
    n = len(order) - 1
    low = np.int64((1 << max(1, (P - 1).bit_length())) - 1)
    room = np.ascontiguousarray(cnt.T).reshape(-1)  # [rank of the host, host], flattened
    # A rank's key: its load's bits above (non-negative floats order as integers; the load is
    # kept to all but the lowest bits), its rank below, so one min per host gives both; full: max.
    keys = np.where(room > 0, np.repeat(np.arange(P, dtype=np.int64), H), _KEY_MAX)
    by_rank = keys.reshape(P, H)
    members = np.full((H, P, width), n, dtype=np.int32 if n < 2**31 else np.int64)
    flat = members.reshape(-1)
    fill = (np.arange(H)[None, :] * P + np.arange(P)[:, None]).reshape(-1) * width  # next place in each rank's row
    end = fill + room
    every = np.arange(H, dtype=np.int64)
    complete = (block < n).all(axis=1)
    for k, pos in enumerate(block):
        if complete[k]:
            hosts = every
            least = by_rank.min(axis=0)
        else:
            hosts = np.flatnonzero(pos < n)
            pos = pos[hosts]
            least = by_rank[:, hosts].min(axis=0)
        rank = least & low
        at = rank * H + hosts
        load = (keys[at] & ~low).view(np.float64) + y[pos]
        place = fill[at]
        flat[place] = order[pos]
        place += 1
        fill[at] = place
        key = load.view(np.int64) & ~low
        key |= rank
        key[place == end[at]] = _KEY_MAX
        keys[at] = key
    return members.reshape(H * P, width)


PARTITIONS: dict[str, Callable[[np.ndarray, int], list[np.ndarray]]] = {
    "contiguous": contiguous,
    "zigzag": zigzag,
    "karmarkar_karp": karmarkar_karp,
    "greedy": greedy,
    "vbs": vbs,
    "hierarchical": hierarchical,
}


def whole_view(partition: Callable[[np.ndarray, int], list[np.ndarray]]):
    """A partition function's ``RankView``, from the whole partition (for the functions that
    cannot be split: every rank computes every rank's part)."""
    def view(costs, ranks: int, rank: int, asked) -> RankView:
        parts = partition(costs, ranks)
        owner = np.empty(sum(len(p) for p in parts), dtype=np.int64)
        for r, p in enumerate(parts):
            owner[p] = r
        return RankView(part=parts[rank], owners=owner[np.asarray(asked, dtype=np.int64)])

    return view


RANK_VIEWS: dict[str, Callable[[np.ndarray, int, int, np.ndarray], RankView]] = {
    **{name: whole_view(fn) for name, fn in PARTITIONS.items()},
    "hierarchical": hierarchical_view,
}
"""By partition name: ``(costs, ranks, rank, asked) -> RankView``, what the balancer runs on each
rank (``hierarchical`` solves only the hosts the rank needs; the others the whole partition)."""


def imbalance(costs, parts: list[np.ndarray]) -> float:
    """Max rank cost / mean rank cost."""
    loads = np.array([np.asarray(costs, dtype=np.float64)[p].sum() for p in parts])
    return float(loads.max() / loads.mean()) if loads.mean() > 0 else 1.0


def lower_bound(costs, ranks: int) -> float:
    """No partition beats max(largest sample, mean rank cost) / mean rank cost."""
    costs = np.asarray(costs, dtype=np.float64)
    mean = costs.sum() / ranks
    return float(max(costs.max(), mean) / mean) if mean > 0 else 1.0


EXACT_BOUND_UP_TO = 8192
"""Up to this many ranks ``equal_count_bound`` tries every ``t``; above, a sample of them."""


def equal_count_bound(costs, ranks: int) -> float:
    """No equal-count partition beats this max rank cost / mean rank cost.

    With ``count`` samples per rank: take the ``t`` largest samples, and say they lie on ``u``
    ranks. Those ranks hold ``u * count`` samples: the ``t`` largest and ``u * count - t``
    others, at least the smallest ones, so the heaviest of them costs at least their total
    over ``u``. Whatever ``u`` is, the max is at least the least of these over ``u``; the
    bound is the largest such value over ``t`` (``t = 1``: the largest sample plus the
    ``count - 1`` smallest others). Above ``EXACT_BOUND_UP_TO`` ranks (where every ``t`` takes
    minutes) the largest over ``t`` up to 1024 and 256 more spread geometrically up to
    ``ranks``: still a bound, and within 0.01% of the full one on the benchmark's lengths at
    8192 ranks.
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
    if len(top_t) > EXACT_BOUND_UP_TO:
        sample = np.unique(np.concatenate([top_t[:1024], np.geomspace(1, len(top_t), 256).astype(np.int64),
                                           top_t[-1:]]))
        for t in sample.tolist():  # u <= t: more ranks than samples leaves some without one
            u = top_t[:t]
            others = u * count - t
            valid = (others >= 0) & (others <= n - t)
            best = max(best, float(((top[t - 1] + prefix[np.clip(others, 0, n)]) / u)[valid].min()))
        return float(max(best, mean) / mean)
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
