"""Retrieval samples' candidates: the user's next item, then uniform negatives.

A retrieval sample (``task.kind: retrieval``) is a history window plus candidates
``[next item, negative_1, ..., negative_N]`` with labels ``[1, 0, ..., 0]`` (one label column)
and every candidate's time the next item's. The model predicts the next item at every history
position itself; the candidates add the window's last target and sampled negatives.

Negative ``j`` of a sample is ``hash(seed, sample id, j) % num_items``: uniform over the item
table (it may equal the next item, as a uniform draw may), and a pure function of the sample,
so a replayed, resumed or re-partitioned sample has the same negatives.
"""

from __future__ import annotations

import numpy as np


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer: a cheap, well-spread integer hash (uint64 in and out)."""
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return x


def uniform_negatives(sample_ids: np.ndarray, *, seed: int, count: int, num_items: int) -> np.ndarray:
    """int64 [len(sample_ids) * count]: each sample's ``count`` negatives, sample-major."""
    ids = np.asarray(sample_ids, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        key = splitmix64(ids ^ (np.uint64(seed & 0xFFFFFFFF) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(0x6E6567)))
        draws = splitmix64(key[:, None] + np.arange(1, count + 1, dtype=np.uint64)[None, :] * np.uint64(0xD1B54A32D192ED03))
    return (draws.reshape(-1) % np.uint64(num_items)).astype(np.int64)


def next_item_candidates(sample_ids: np.ndarray, next_items: np.ndarray, next_times: np.ndarray, *, seed: int,
                         num_negatives: int, num_items: int):
    """(cand_counts, cand_values, cand_timestamps, labels [.., 1]) of retrieval samples."""
    n = len(sample_ids)
    per = 1 + num_negatives
    values = np.empty((n, per), dtype=np.int64)
    values[:, 0] = next_items
    values[:, 1:] = uniform_negatives(sample_ids, seed=seed, count=num_negatives, num_items=num_items).reshape(n, num_negatives)
    labels = np.zeros((n, per, 1), dtype=np.float32)
    labels[:, 0, 0] = 1.0
    return (np.full(n, per, dtype=np.int64), values.reshape(-1),
            np.repeat(np.asarray(next_times, dtype=np.int64), per), labels.reshape(n * per, 1))
