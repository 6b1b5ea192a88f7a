import numpy as np
import pytest

from freescale.config import SyntheticDataConfig
from freescale.data.synthetic import BLOCK, EVAL_ID_OFFSET, SyntheticSource, sample_uih_lengths


def source(split="train", seed=3, **kw):
    cfg = SyntheticDataConfig(**kw)
    return SyntheticSource(cfg, seed=seed, split=split, min_uih_len=1, max_uih_len=4096, num_candidates=3)


def assert_same(a, b):
    for name in a.__dataclass_fields__:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def test_same_seed_same_samples_any_access_order():
    pos = np.arange(BLOCK - 40, BLOCK + 40)  # spans two blocks
    a = source().samples_at(pos)
    b = source().samples_at(pos)
    assert_same(a, b)
    # Random access returns exactly the contiguous read's samples, in the order asked.
    shuffled = np.random.default_rng(0).permutation(pos)
    c = source().samples_at(shuffled)
    order = np.argsort(shuffled)
    assert_same(c.select(order), a)
    np.testing.assert_array_equal(a.sample_ids, pos)


def test_other_seed_or_split_gives_other_samples():
    pos = np.arange(64)
    a, b, e = source().samples_at(pos), source(seed=4).samples_at(pos), source(split="eval").samples_at(pos)
    assert not np.array_equal(a.uih_lengths, b.uih_lengths)
    assert not np.array_equal(a.uih_lengths, e.uih_lengths)
    assert e.sample_ids.min() >= EVAL_ID_OFFSET


def test_jagged_fields_are_consistent():
    s = source().samples_at(np.arange(500))
    assert s.uih_values.shape[0] == s.uih_lengths.sum()
    assert s.cand_values.shape[0] == s.cand_counts.sum() == s.labels.shape[0]
    assert (s.cand_counts == 3).all()
    assert s.uih_values.min() >= 0 and s.uih_values.max() < SyntheticDataConfig().num_items
    assert set(np.unique(s.labels)) <= {0.0, 1.0}


def test_length_distribution_shape():
    cfg = SyntheticDataConfig(median_uih_len=48, sigma=0.8, tail_prob=0.02, tail_min_len=512, tail_alpha=1.2)
    rng = np.random.default_rng(0)
    n = 400_000
    lengths = sample_uih_lengths(cfg, n, min_len=1, max_len=20_000, rng=rng)
    assert lengths.min() >= 1 and lengths.max() <= 20_000
    # Lognormal body: the median sits at the configured median.
    assert abs(np.median(lengths) - 48) / 48 < 0.05
    # Pareto tail: about tail_prob of samples at or beyond its scale...
    beyond = (lengths >= 512).mean()
    body_beyond = 1 - 0.5 * (1 + _erf(np.log(512 / 48) / (0.8 * np.sqrt(2))))
    assert abs(beyond - (0.02 + 0.98 * body_beyond)) < 0.002
    # ...with the power-law survival of a Pareto: P(L > 4x | L > x) = 4^-alpha.
    tail = lengths[lengths >= 1024]
    ratio = (tail >= 4096).mean()
    assert abs(ratio - 4 ** -1.2) < 0.03
    # Heavy: the longest histories dwarf the median, and clipping holds at max_uih_len.
    assert lengths.max() == 20_000
    assert np.percentile(lengths, 99.9) > 50 * np.median(lengths)


def _erf(x):
    import math

    return math.erf(x)


def test_planted_signal_is_in_the_history():
    src = source()
    s = src.samples_at(np.arange(2 * BLOCK))
    owner = np.repeat(np.arange(len(s)), s.cand_counts)
    prefs = src.preferred_clusters(s.user_ids)
    cand_cluster = s.cand_values % src.cfg.num_clusters
    preferred = (prefs[owner] == cand_cluster[:, None]).any(axis=1)
    # Clicks concentrate on preferred clusters...
    assert s.labels[preferred].mean() > s.labels[~preferred].mean() + 0.3
    # ...and a history shows them: most events fall in the user's preferred clusters.
    uih_owner = np.repeat(np.arange(len(s)), s.uih_lengths)
    in_pref = (prefs[uih_owner] == (s.uih_values % src.cfg.num_clusters)[:, None]).any(axis=1)
    assert in_pref.mean() > 0.75


def test_rejects_more_clusters_than_items():
    with pytest.raises(ValueError, match="num_items"):
        source(num_items=4, num_clusters=8)


def _shared_share(s, batch=64, batches=8):
    """Mean share of a batch's distinct items that the batch before it also has."""
    shares = []
    for k in range(1, batches):
        prev = s.samples_at(np.arange((k - 1) * batch, k * batch))
        cur = s.samples_at(np.arange(k * batch, (k + 1) * batch))
        a = set(np.concatenate([prev.uih_values, prev.cand_values]).tolist())
        b = set(np.concatenate([cur.uih_values, cur.cand_values]).tolist())
        shares.append(len(a & b) / len(b))
    return float(np.mean(shares))


def test_hot_items_set_the_share_of_rows_consecutive_batches_have_in_common():
    big = dict(num_items=2_000_000, hot_items=256, median_uih_len=16.0, tail_prob=0.0)
    shares = [_shared_share(source(hot_prob=p, **big)) for p in (0.0, 0.2, 0.6, 1.0)]
    assert shares[0] < 0.01  # millions of rows, drawn uniformly: hardly any in common
    assert shares == sorted(shares) and shares[-1] > 0.9
    s = source(hot_prob=1.0, **big).samples_at(np.arange(256))
    within = np.concatenate([s.uih_values, s.cand_values]) // 16  # index within the item's cluster
    assert within.max() < 256 // 16  # every item is one of its cluster's hot ones
    # The knob off leaves the stream as it was.
    assert_same(source(hot_items=256).samples_at(np.arange(300)), source().samples_at(np.arange(300)))
