import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from freescale.balance.cost import CostModel, fit_cost_model
from freescale.balance.partition import (PARTITIONS, RANK_VIEWS, _greedy_members, equal_count_bound, hierarchical,
                                         hierarchical_host, hierarchical_rank, hierarchical_view, host_split, imbalance,
                                         lower_bound)
from freescale.config import SyntheticDataConfig
from freescale.data.synthetic import sample_uih_lengths

EQUAL_COUNTS = ("contiguous", "zigzag", "karmarkar_karp", "greedy", "hierarchical")


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(1, 5000), min_size=0, max_size=300), ranks=st.integers(1, 17),
       name=st.sampled_from(sorted(PARTITIONS)))
def test_partition_invariants(lengths, ranks, name):
    costs = CostModel().cost(np.array(lengths, dtype=np.int64))
    parts = PARTITIONS[name](costs, ranks)
    assert len(parts) == ranks
    flat = np.concatenate(parts) if parts else np.zeros(0)
    # Every sample exactly once.
    assert sorted(flat.tolist()) == list(range(len(lengths)))
    # Original (time) order inside each rank.
    assert all((np.diff(p) > 0).all() for p in parts)
    # No empty rank when there are enough samples.
    if len(lengths) >= ranks:
        assert all(len(p) > 0 for p in parts)
    if name in EQUAL_COUNTS:
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1
    # Deterministic.
    again = PARTITIONS[name](costs, ranks)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))


def test_contiguous_is_a_sampler_split():
    parts = PARTITIONS["contiguous"](np.ones(10), 3)
    assert [p.tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]


def test_zigzag_deals_in_snake_order():
    costs = np.array([1.0, 9.0, 5.0, 7.0, 3.0, 8.0])  # sorted: 9(1) 8(5) 7(3) 5(2) 3(4) 1(0)
    parts = PARTITIONS["zigzag"](costs, 3)
    assert [p.tolist() for p in parts] == [[0, 1], [4, 5], [2, 3]]


def heavy_tailed(n, seed=0):
    cfg = SyntheticDataConfig(median_uih_len=64, sigma=1.0, tail_prob=0.05, tail_min_len=256, tail_alpha=1.1)
    return sample_uih_lengths(cfg, n, 1, 2048, np.random.default_rng(seed))


def test_karmarkar_karp_balances_heavy_tails_at_256_ranks():
    lengths = heavy_tailed(256 * 64)
    costs = CostModel().cost(lengths, np.full(len(lengths), 4))
    assert lower_bound(costs, 256) < 1.05 and equal_count_bound(costs, 256) < 1.05
    kk = imbalance(costs, PARTITIONS["karmarkar_karp"](costs, 256))
    contiguous = imbalance(costs, PARTITIONS["contiguous"](costs, 256))
    assert kk <= 1.05
    assert contiguous > 1.5
    assert imbalance(costs, PARTITIONS["zigzag"](costs, 256)) < contiguous
    assert imbalance(costs, PARTITIONS["vbs"](costs, 256)) <= 1.05


def test_partitioning_256_ranks_takes_milliseconds():
    costs = CostModel().cost(heavy_tailed(256 * 64, seed=1))
    for name, fn in PARTITIONS.items():
        fn(costs, 256)  # warm
        t0 = time.perf_counter()
        fn(costs, 256)
        assert time.perf_counter() - t0 < 1.0, name  # a loose bound: bench_balance.py reports the real figure


def test_fit_recovers_known_coefficients():
    truth = CostModel(a=3e-6, b=2e-9, c=1e-5, d=2e-4)
    L = np.repeat([8, 32, 128, 512, 2048], 3)
    C = np.tile([1, 4, 16], 5)
    model = fit_cost_model(L, C, truth.cost(L, C))
    assert model.fit["r2"] > 0.999999
    for name in "abcd":
        assert getattr(model, name) == pytest.approx(getattr(truth, name), rel=1e-6)


def test_fit_never_returns_negative_coefficients():
    L = np.array([8, 16, 32, 64, 128])
    C = np.ones(5)
    y = 1e-4 + 1e-6 * L  # no quadratic part, slight noise below
    y = y * np.array([1.0, 0.99, 1.01, 1.0, 0.995])
    model = fit_cost_model(L, C, y)
    assert min(model.a, model.b, model.c, model.d) >= 0
    assert model.fit["worst_relative_error"] < 0.05


def test_cost_model_round_trip_and_errors(tmp_path):
    from freescale.balance.cost import CostModelError

    path = tmp_path / "cost.json"
    CostModel(a=1.0, b=2.0, c=3.0, d=4.0, fit={"r2": 0.9}).save(str(path))
    loaded = CostModel.load(str(path))
    assert (loaded.a, loaded.b, loaded.c, loaded.d) == (1.0, 2.0, 3.0, 4.0) and loaded.fit == {"r2": 0.9}
    with pytest.raises(CostModelError, match="not found"):
        CostModel.load(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text('{"a": 1, "q": 2}')
    with pytest.raises(CostModelError, match="not a cost model"):
        CostModel.load(str(tmp_path / "bad.json"))


def _brute_force_best(costs: np.ndarray, ranks: int) -> float:
    """The least max rank cost over every equal-count partition (tiny inputs only)."""
    import itertools

    count = len(costs) // ranks
    best = np.inf

    def place(left, loads):
        nonlocal best
        if not left:
            best = min(best, max(loads))
            return
        first, rest = left[0], left[1:]
        for group in itertools.combinations(rest, count - 1):
            members = (first, *group)
            place([i for i in rest if i not in group], loads + [costs[list(members)].sum()])

    place(list(range(len(costs))), [])
    return best / (costs.sum() / ranks)


def test_the_equal_count_bound_is_never_above_the_best_partition_and_beats_the_largest_sample_alone():
    rng = np.random.default_rng(0)
    for _ in range(30):
        ranks, count = int(rng.integers(2, 4)), int(rng.integers(2, 4))
        costs = rng.pareto(1.2, ranks * count) + 0.1
        assert equal_count_bound(costs, ranks) <= _brute_force_best(costs, ranks) + 1e-12
    # Two large samples, three ranks of two: the largest with the smallest other costs 11, but
    # the two large ones share the small ones (on one rank: 20; on two: at least (20+1+2)/2).
    costs = np.array([10.0, 10.0, 1.0, 2.0, 2.0, 2.0])
    assert equal_count_bound(costs, 3) == pytest.approx(11.5 / 9)
    assert _brute_force_best(costs, 3) == pytest.approx(12.0 / 9)


@pytest.mark.parametrize("tail", ["light", "heavy"])
def test_1024_ranks_of_64_samples_are_balanced_within_a_percent_of_the_bound(tail):
    # "heavy" (configs/bench_balance.yaml's lengths): samples so long that the ranks holding
    # them cannot come down to the mean (the bound is above 1), the case that takes the most swaps.
    cfg = (SyntheticDataConfig(median_uih_len=64, sigma=1.0, tail_prob=0.05, tail_min_len=256, tail_alpha=1.1)
           if tail == "light" else
           SyntheticDataConfig(median_uih_len=32, sigma=1.0, tail_prob=0.03, tail_min_len=384, tail_alpha=1.0))
    lengths = sample_uih_lengths(cfg, 1024 * 64, 1, 2048, np.random.default_rng(1024))
    costs = CostModel(a=1.3e-5, b=5.4e-8, c=6.7e-6, d=7.6e-5).cost(lengths, np.full(len(lengths), 4))
    bound = max(lower_bound(costs, 1024), equal_count_bound(costs, 1024))
    assert (bound > 1.02) == (tail == "heavy")
    assert imbalance(costs, PARTITIONS["greedy"](costs, 1024)) <= 1.01 * bound
    # The blocked greedy assignment is close already; the swaps only finish it.
    members = _greedy_members(costs, 1024)
    assert sorted(members.ravel().tolist()) == list(range(len(costs)))
    loads = costs[members].sum(axis=1)
    assert loads.max() / loads.mean() <= 1.005 * bound
    assert imbalance(costs, PARTITIONS["contiguous"](costs, 1024)) > 1.5 * bound


HEAVY = SyntheticDataConfig(median_uih_len=32, sigma=1.0, tail_prob=0.03, tail_min_len=384, tail_alpha=1.0)


@pytest.mark.parametrize("ranks", [8192, 8195])  # 8195: a last host of 3 ranks
def test_hierarchical_balances_8k_ranks_and_each_rank_can_solve_only_its_part(ranks):
    lengths = sample_uih_lengths(HEAVY, ranks * 64, 1, 2048, np.random.default_rng(ranks))
    costs = CostModel(a=1.3e-5, b=5.4e-8, c=6.7e-6, d=7.6e-5).cost(lengths, np.full(len(lengths), 4))
    parts = hierarchical(costs, ranks)
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(costs)))
    counts = np.array([len(p) for p in parts])
    assert counts.max() - counts.min() <= 1
    bound = max(lower_bound(costs, ranks), equal_count_bound(costs, ranks))
    assert bound > 1.05  # the heavy tail binds
    assert imbalance(costs, parts) <= 1.01 * bound
    # Every host's parts balanced on their own, not only the whole: hosts first.
    host = host_split(costs, ranks)
    for r in (0, 9, ranks // 2, ranks - 1):
        assert (host[parts[r]] == r // 8).all()
        assert np.array_equal(hierarchical_rank(costs, ranks, r), parts[r])
    last = (ranks - 1) // 8
    mine = hierarchical_host(costs, ranks, last)
    assert len(mine) == ranks - 8 * last
    assert all(np.array_equal(a, b) for a, b in zip(mine, parts[8 * last:]))
    assert np.bincount(host, minlength=last + 1).tolist() == [int(counts[8 * h:8 * h + 8].sum()) for h in range(last + 1)]


def test_hierarchical_with_many_samples_tied_at_the_length_cap():
    # A quarter of the ranks get a sample at the cap, each 0.6 of a rank's mean load: their
    # ranks must take the smallest companions, whichever host they land on.
    lengths = sample_uih_lengths(SyntheticDataConfig(), 1024 * 64, 1, 2048, np.random.default_rng(0))
    costs = lengths.astype(np.float64) ** 1.3 + 50
    assert (costs == costs.max()).sum() > 200
    bound = max(lower_bound(costs, 1024), equal_count_bound(costs, 1024))
    assert imbalance(costs, hierarchical(costs, 1024)) <= 1.025 * bound


def test_hierarchical_errors_name_what_was_wrong():
    costs = np.ones(64)
    with pytest.raises(ValueError, match="ranks_per_host must be a positive integer"):
        hierarchical(costs, 8, ranks_per_host=0)
    with pytest.raises(ValueError, match=r"host must be an integer in \[0, 2\)"):
        hierarchical_host(costs, 16, 2)
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 16\)"):
        hierarchical_rank(costs, 16, 16)
    with pytest.raises(ValueError, match="finite and non-negative"):
        hierarchical(np.array([1.0, -1.0] * 8), 4)


def _owners(parts, n):
    owner = np.full(n, -1, dtype=np.int64)
    for r, p in enumerate(parts):
        owner[p] = r
    return owner


def _assert_views_match_the_whole_solve(costs, ranks, per_host, extra):
    """Every rank's ``hierarchical_view`` (its own slice asked, as the balancer asks, plus
    ``extra`` samples) against ``hierarchical``'s parts."""
    parts = hierarchical(costs, ranks, per_host)
    owner = _owners(parts, len(costs))
    bounds = np.concatenate([[0], np.cumsum([len(p) for p in parts])])
    for r in range(ranks):
        asked = np.concatenate([np.arange(bounds[r], bounds[r + 1]), extra]).astype(np.int64)
        view = RANK_VIEWS["hierarchical"](costs, ranks, r, asked) if per_host == 8 else \
            hierarchical_view(costs, ranks, r, asked, per_host)
        assert view.part.dtype == np.int64 and np.array_equal(view.part, parts[r]), r
        assert np.array_equal(view.owners, owner[asked]), r


@settings(max_examples=120, deadline=None)
@given(data=st.data(), ranks=st.integers(1, 40), per_host=st.integers(1, 9), per_rank=st.integers(0, 24),
       shape=st.sampled_from(["pareto", "ties", "lognormal", "one giant"]), seed=st.integers(0, 2**32 - 1))
def test_each_ranks_view_is_the_whole_hierarchical_solve(data, ranks, per_host, per_rank, shape, seed):
    """A rank solves the host split, its own host and the hosts its samples go to, never the
    others': its part and the ranks of the samples it sends are the whole solve's, for random
    costs (heavy tails that anchor ranks, many ties, a sample above all others), rank counts,
    host sizes (a last host with fewer ranks) and samples per rank (more than LPT_ROUNDS per
    host: snake rounds)."""
    rng = np.random.default_rng(seed)
    n = ranks * per_rank + data.draw(st.integers(0, ranks - 1))
    costs = {"pareto": lambda: rng.pareto(1.0, n), "ties": lambda: rng.integers(0, 3, n).astype(np.float64),
             "lognormal": lambda: np.round(rng.lognormal(0.0, 2.0, n), 2),
             "one giant": lambda: np.concatenate([rng.random(n - 1), [1e3]])[rng.permutation(n)] if n else np.zeros(0),
             }[shape]()
    extra = rng.choice(n, size=min(n, 3), replace=False) if n else np.zeros(0, dtype=np.int64)
    _assert_views_match_the_whole_solve(costs, ranks, per_host, extra)


def test_views_at_a_thousand_ranks_with_heavy_tails():
    """Sizes where every part of the host split is in play: saturated anchors with companions,
    anchors with windows, hosts with fewer free ranks (several capacities in one deal), and
    snake rounds after the load-ordered ones."""
    for ranks, per_rank, seed in ((1003, 16, 0), (256, 72, 1)):
        lengths = sample_uih_lengths(HEAVY, ranks * per_rank, 1, 2048, np.random.default_rng(seed))
        costs = CostModel(a=1.3e-5, b=5.4e-8, c=6.7e-6, d=7.6e-5).cost(lengths, np.full(len(lengths), 4))
        parts = hierarchical(costs, ranks)
        owner = _owners(parts, len(costs))
        for r in np.random.default_rng(seed).choice(ranks, size=24, replace=False).tolist():
            asked = np.arange(r * per_rank, (r + 1) * per_rank)
            view = hierarchical_view(costs, ranks, r, asked)
            assert np.array_equal(view.part, parts[r]) and np.array_equal(view.owners, owner[asked]), r


def test_every_partition_has_a_rank_view_that_agrees_with_it():
    costs = CostModel().cost(heavy_tailed(7 * 10 + 3, seed=2))
    assert set(RANK_VIEWS) == set(PARTITIONS)
    for name, fn in PARTITIONS.items():
        parts = fn(costs, 7)
        owner = _owners(parts, len(costs))
        for r in range(7):
            asked = np.arange(r * 10, r * 10 + 10)
            view = RANK_VIEWS[name](costs, 7, r, asked)
            assert np.array_equal(view.part, parts[r]) and np.array_equal(view.owners, owner[asked]), name
