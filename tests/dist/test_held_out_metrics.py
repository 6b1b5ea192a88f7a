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


def _two_labels(rank, world):
    from freescale.train.metrics import gauc

    logits, labels = data(1200, seed=1)
    second_logits, second = data(1200, seed=2)
    users = np.random.default_rng(3).integers(0, 40, 1200)  # a user's candidates on both ranks
    x = torch.from_numpy(np.stack([logits, second_logits], 1))
    y = torch.from_numpy(np.stack([labels, second], 1))
    mine = slice(0, 500) if rank == 0 else slice(500, None)
    metrics = HeldOutMetrics(dist.group.WORLD, batch_size=128, labels=["click", "liked"])
    metrics.update(x[mine], y[mine], torch.from_numpy(users[mine]))
    got = metrics.compute()
    for k, (name, lab, lo) in enumerate([("click", labels, logits), ("liked", second, second_logits)]):
        assert got[f"eval/{name}/auc"] == pytest.approx(auc(lab, lo), abs=2e-6)
        assert got[f"eval/{name}/ne"] == pytest.approx(normalized_entropy(lab, lo), abs=2e-6)
        assert got[f"eval/{name}/loss"] == pytest.approx(log_loss(lab, lo), abs=2e-6)
        assert got[f"eval/{name}/gauc"] == pytest.approx(gauc(users, lab, lo)[0], abs=1e-6)
    assert got["eval/auc"] == got["eval/click/auc"] and got["eval/gauc"] == got["eval/click/gauc"]
    assert got["eval/auc"] != got["eval/liked/auc"]


def test_each_label_has_its_own_figures_and_gauc_spans_the_ranks():
    run_ranks(2, _two_labels)
