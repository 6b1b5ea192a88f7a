"""Held-out metrics from TorchRec's metrics module over the ranks of a group agree with the
NumPy measures over every rank's samples at once (2 gloo ranks, uneven shares, one empty
batch)."""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from freescale.train.metrics import HeldOutMetrics, auc, log_loss, normalized_entropy
from helpers.spawn import run_ranks

pytestmark = pytest.mark.slow


def data(n=3000, seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 1.5, n).astype(np.float32)
    labels = (rng.random(n) < 1 / (1 + np.exp(-logits))).astype(np.float32)
    return logits, labels


def _agree(rank, world):
    logits, labels = data()
    cut = 1100  # rank 0 holds 1100 candidates, rank 1 the other 1900
    mine = slice(0, cut) if rank == 0 else slice(cut, None)
    metrics = HeldOutMetrics(dist.group.WORLD, batch_size=128)
    x, y = torch.from_numpy(logits[mine]), torch.from_numpy(labels[mine])
    for at in range(0, len(x), 128):
        metrics.update(x[at:at + 128], y[at:at + 128])
    metrics.update(x[:0], y[:0])  # an empty batch changes nothing
    got = metrics.compute()
    assert got["eval/samples"] == len(logits)
    assert got["eval/auc"] == pytest.approx(auc(labels, logits), abs=2e-6)
    assert got["eval/ne"] == pytest.approx(normalized_entropy(labels, logits), abs=2e-6)
    assert got["eval/loss"] == pytest.approx(log_loss(labels, logits), abs=2e-6)
    # Calibration: predicted clicks over actual clicks.
    assert got["eval/calibration"] == pytest.approx((1 / (1 + np.exp(-logits.astype(np.float64)))).sum()
                                                    / labels.sum(), rel=1e-5)
    empty = HeldOutMetrics(dist.group.WORLD, batch_size=128)
    assert empty.compute() == {}


def test_torchrec_metrics_across_ranks_agree_with_the_reference():
    run_ranks(2, _agree)
