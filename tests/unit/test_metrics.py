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
