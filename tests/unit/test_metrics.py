import itertools
import math

import numpy as np

from freescale.train.metrics import auc, log_loss, normalized_entropy


def brute_auc(labels, scores):
    pos = [s for s, y in zip(scores, labels) if y == 1]
    neg = [s for s, y in zip(scores, labels) if y == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def test_auc_matches_pair_counting_with_ties():
    rng = np.random.default_rng(0)
    for _ in range(20):
        labels = rng.integers(0, 2, 60).astype(float)
        scores = rng.integers(0, 8, 60).astype(float)  # many ties
        assert math.isclose(auc(labels, scores), brute_auc(labels, scores), rel_tol=1e-12)
    assert auc(np.array([0, 0, 1, 1]), np.array([0.1, 0.2, 0.8, 0.9])) == 1.0
    assert math.isnan(auc(np.ones(4), np.arange(4.0)))


def test_normalized_entropy_of_the_base_rate_is_one():
    labels = np.array([1, 0, 0, 0] * 25, dtype=float)
    base_logit = math.log(0.25 / 0.75)
    assert math.isclose(normalized_entropy(labels, np.full(100, base_logit)), 1.0, rel_tol=1e-9)
    good = np.where(labels == 1, 3.0, -3.0)
    assert normalized_entropy(labels, good) < 0.3
    assert math.isclose(log_loss(np.array([1.0]), np.array([0.0])), math.log(2))


def test_gauc_is_the_mean_of_each_users_pair_counted_auc():
    from freescale.train.metrics import gauc

    rng = np.random.default_rng(3)
    users = rng.integers(0, 6, 60)
    labels = (rng.random(60) < 0.4).astype(np.float32)
    scores = np.round(rng.normal(size=60), 1)  # ties within a user
    users[users == 5] = 5
    labels[users == 5] = 1.0  # a user with positives only: left out
    per_user = []
    for u in np.unique(users):
        pos = scores[(users == u) & (labels == 1)]
        neg = scores[(users == u) & (labels == 0)]
        if len(pos) and len(neg):
            wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
            per_user.append(wins / (len(pos) * len(neg)))
    got, counted = gauc(users, labels, scores)
    assert counted == len(per_user) == 5
    assert math.isclose(got, float(np.mean(per_user)), rel_tol=1e-12)
    # Not the pooled AUC: the users' base rates differ.
    assert not math.isclose(got, auc(labels, scores), rel_tol=1e-3)


def test_rank_metrics_against_a_direct_computation():
    from freescale.train.retrieval import rank_metrics

    rng = np.random.default_rng(0)
    ranks = rng.integers(0, 300, 500)
    got = rank_metrics(ranks, [10, 50, 200])
    for k in (10, 50, 200):
        hits = [r for r in ranks if r < k]
        assert math.isclose(got[f"eval/hr@{k}"], len(hits) / len(ranks), abs_tol=1e-6)
        assert math.isclose(got[f"eval/ndcg@{k}"], sum(1 / math.log2(r + 2) for r in hits) / len(ranks), abs_tol=1e-6)
    assert math.isclose(got["eval/mrr"], sum(1 / (r + 1) for r in ranks) / len(ranks), abs_tol=1e-6)
    assert math.isclose(got["eval/mrr@10"], sum(1 / (r + 1) for r in ranks if r < 10) / len(ranks), abs_tol=1e-6)
    assert got["eval/users"] == 500
