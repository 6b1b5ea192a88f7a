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


def test_lengths_at_are_the_lengths_and_candidate_counts_of_the_samples_there():
    # Positions over three blocks, out of order, for both tasks, against the samples themselves.
    pos = np.random.default_rng(1).permutation(np.arange(BLOCK - 300, 2 * BLOCK + 300))[:900]
    for src in (source(), source(split="eval", seed=5), retrieval(negatives=7)):
        lengths, counts = src.lengths_at(pos)
        samples = src.samples_at(pos)
        np.testing.assert_array_equal(lengths, samples.uih_lengths)
        np.testing.assert_array_equal(counts, samples.cand_counts)


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


def test_times_run_forward_through_the_stream_and_back_through_each_history():
    from freescale.data.synthetic import REQUEST_GAP, START_TIME

    pos = np.arange(BLOCK - 500, BLOCK + 500)  # spans two blocks
    s = source(median_uih_len=32.0).samples_at(pos)
    request = START_TIME + REQUEST_GAP * pos
    # Candidates are shown at the request time, which increases through the stream.
    np.testing.assert_array_equal(s.cand_timestamps, np.repeat(request, s.cand_counts))
    owner = np.repeat(np.arange(len(s)), s.uih_lengths)
    assert s.uih_timestamps.dtype == np.int64 and len(s.uih_timestamps) == s.uih_lengths.sum()
    # Every event is before its request, and a history's times strictly decrease going back.
    assert (s.uih_timestamps < request[owner]).all()
    same = owner[1:] == owner[:-1]
    assert (np.diff(s.uih_timestamps)[same] > 0).all()
    # Heavy-tailed gaps, from minutes to weeks; histories reach back months, not decades.
    ends = np.cumsum(s.uih_lengths)[s.uih_lengths > 0] - 1
    gaps = np.concatenate([np.diff(s.uih_timestamps)[same], request[owner[ends]] - s.uih_timestamps[ends]])
    p = np.percentile(gaps, [5, 50, 95])
    assert 1 <= gaps.min() and p[0] < 3600 and 3600 < p[1] < 86400 and p[2] > 2 * 86400 and gaps.max() > 14 * 86400
    assert s.uih_timestamps.min() > START_TIME - 5 * 365 * 86400
    # A pure function of the position, like the rest of the sample.
    assert_same(source(median_uih_len=32.0).samples_at(pos[::-1]).select(np.arange(len(pos))[::-1]), s)


def test_second_label_is_liked_after_a_click_and_learnable():
    src = source(num_labels=2)
    s = src.samples_at(np.arange(2 * BLOCK))
    assert s.labels.shape == (s.cand_counts.sum(), 2) and s.labels.dtype == np.float32
    click, liked = s.labels[:, 0], s.labels[:, 1]
    # The click column is the one-label stream's, untouched by the second draw.
    np.testing.assert_array_equal(click, source().samples_at(np.arange(2 * BLOCK)).labels[:, 0])
    assert (liked <= click).all() and 0.2 < liked.sum() / click.sum() < 0.95
    owner = np.repeat(np.arange(len(s)), s.cand_counts)
    preferred = (src.preferred_clusters(s.user_ids)[owner] == (s.cand_values % src.cfg.num_clusters)[:, None]).any(axis=1)
    quality = src.item_quality(s.cand_values)
    clicked = click == 1
    # Among clicks, liking follows the preference and the item's quality.
    assert liked[clicked & preferred].mean() > liked[clicked & ~preferred].mean() + 0.2
    good = quality > np.median(quality)
    assert liked[clicked & good].mean() > liked[clicked & ~good].mean() + 0.1


def retrieval(split="train", negatives=5, seed=3):
    return SyntheticSource(SyntheticDataConfig(), seed=seed, split=split, min_uih_len=1, max_uih_len=4096,
                           num_candidates=3, task="retrieval", num_negatives=negatives)


def test_retrieval_candidates_are_the_next_item_then_uniform_negatives():
    from freescale.data.synthetic import START_TIME

    pos = np.arange(3000)
    src = retrieval()
    s = src.samples_at(pos)
    ranking = source().samples_at(pos)
    # The same histories as the ranking stream; candidates = next item + 5 negatives, at the request.
    for name in ("sample_ids", "user_ids", "uih_lengths", "uih_values", "uih_timestamps"):
        np.testing.assert_array_equal(getattr(s, name), getattr(ranking, name), err_msg=name)
    assert (s.cand_counts == 6).all()
    np.testing.assert_array_equal(s.cand_timestamps, np.repeat(START_TIME + pos, 6))
    np.testing.assert_array_equal(s.labels, np.tile([[1.0], [0], [0], [0], [0], [0]], (len(pos), 1)))
    cands = s.cand_values.reshape(len(pos), 6)
    # The next item is drawn like a history event: mostly from the user's preferred clusters...
    prefs = src.preferred_clusters(s.user_ids)
    in_pref = (prefs == (cands[:, :1] % src.cfg.num_clusters)).any(axis=1)
    assert in_pref.mean() > 0.75
    # ...the negatives uniformly over the whole table.
    negatives = cands[:, 1:].reshape(-1)
    assert negatives.min() >= 0 and negatives.max() < src.num_items
    neg_pref = (np.repeat(prefs, 5, axis=0) == (negatives % src.cfg.num_clusters)[:, None]).any(axis=1)
    assert abs(neg_pref.mean() - 2 / 16) < 0.03  # about clusters_per_user / num_clusters (a user's two may coincide)
    assert np.unique(negatives).size > 0.6 * src.num_items
    # Deterministic per sample, different across samples and seeds; eval from the eval stream.
    np.testing.assert_array_equal(retrieval().samples_at(pos[::-1]).cand_values.reshape(-1, 6)[::-1], cands)
    assert (cands[1:, 1:] != cands[:-1, 1:]).any(axis=1).all()
    assert not np.array_equal(retrieval(seed=4).samples_at(pos).cand_values, s.cand_values)
    e = retrieval("eval").samples_at(pos)
    assert e.sample_ids.min() >= EVAL_ID_OFFSET and not np.array_equal(e.cand_values, s.cand_values)


def test_side_features_state_the_clusters_and_draw_nothing():
    pos = np.arange(BLOCK - 40, BLOCK + 40)
    plain = source().samples_at(pos)
    src = source(user_features=True, item_features=True)
    side = src.samples_at(pos)
    for name in plain.__dataclass_fields__:  # the samples themselves are the same
        if name not in ("user_side", "uih_side", "cand_side", "side_layout"):
            np.testing.assert_array_equal(getattr(side, name), getattr(plain, name), err_msg=name)
    assert [(f.name, f.num_values, f.max_values) for f in side.side_layout.user] == [("clusters", 16, 2)]
    assert [(f.name, f.num_values, f.max_values) for f in side.side_layout.item] == [("cluster", 16, 1)]
    np.testing.assert_array_equal(side.user_side, src.preferred_clusters(side.user_ids))
    np.testing.assert_array_equal(side.uih_side, (side.uih_values % 16)[:, None])
    np.testing.assert_array_equal(side.cand_side, (side.cand_values % 16)[:, None])
    assert plain.user_side.shape == (len(pos), 0) and plain.side_layout == source().side_layout
    # Retrieval's negatives carry their clusters too; item_side gives any item's.
    retrieval = SyntheticSource(SyntheticDataConfig(item_features=True), seed=3, split="train", min_uih_len=1,
                                max_uih_len=64, num_candidates=1, task="retrieval", num_negatives=5)
    r = retrieval.samples_at(np.arange(20))
    np.testing.assert_array_equal(r.cand_side[:, 0], r.cand_values % 16)
    np.testing.assert_array_equal(retrieval.item_side(np.array([3, 17, 40])), [[3], [1], [8]])
