"""Quality metrics (AUC, normalized entropy) and the run's metrics.jsonl writer."""

from __future__ import annotations

import json
import math
import os

import numpy as np


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U, ties counted half). NaN with one class only."""
    labels = np.asarray(labels, dtype=np.float64)
    scores = np.asarray(scores, dtype=np.float64)
    n_pos = labels.sum()
    n_neg = len(labels) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(len(scores), dtype=np.float64)
    # Average rank within runs of equal scores.
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], len(scores)]
    avg = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[labels == 1].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def log_loss(labels: np.ndarray, logits: np.ndarray) -> float:
    """Mean binary cross-entropy of logits, computed stably."""
    x = np.asarray(logits, dtype=np.float64)
    y = np.asarray(labels, dtype=np.float64)
    return float(np.mean(np.maximum(x, 0) - x * y + np.log1p(np.exp(-np.abs(x)))))


def normalized_entropy(labels: np.ndarray, logits: np.ndarray) -> float:
    """Log loss divided by the entropy of the base click rate (1.0 = no better than the rate)."""
    p = float(np.mean(labels))
    if p <= 0.0 or p >= 1.0:
        return float("nan")
    base = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    return log_loss(labels, logits) / base


class MetricsLog:
    """Appends one JSON object per line to ``metrics.jsonl`` (written by the main rank only)."""

    def __init__(self, path: str, enabled: bool) -> None:
        self.path = path
        self.enabled = enabled

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
