"""Quality metrics and the run's metrics.jsonl writer.

Held-out evaluation (``HeldOutMetrics``) uses TorchRec's metrics module: AUC, normalized
entropy and calibration over the ranks of a replica, each rank updating with its own
samples. ``auc``, ``log_loss`` and ``normalized_entropy`` are the same measures in NumPy over
one array, the reference the tests hold TorchRec's to. ``MetricsLog`` writes the run's
metrics.jsonl and, with run.tensorboard, the same scalars as TensorBoard event files.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from freescale.config import ConfigError
from freescale.io import rewind_jsonl

EVAL_TASK = "ctr"
WHOLE_SET = 2**40
"""TorchRec's metrics keep a window of the latest samples; this one holds every held-out sample."""


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


def gauc(users: np.ndarray, labels: np.ndarray, scores: np.ndarray) -> tuple[float, int]:
    """Group AUC: the AUC of each user's candidates, averaged over the users who have both a
    positive and a negative one (unweighted); with how many users that is. NaN with none."""
    users = np.asarray(users)
    order = np.argsort(users, kind="stable")
    users, labels, scores = users[order], np.asarray(labels)[order], np.asarray(scores)[order]
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]]) if len(users) else np.zeros(0, dtype=np.int64)
    ends = np.r_[starts[1:], len(users)]
    per_user = [auc(labels[a:b], scores[a:b]) for a, b in zip(starts, ends)]
    counted = [v for v in per_user if not math.isnan(v)]
    return (float(np.mean(counted)) if counted else float("nan")), len(counted)


class HeldOutMetrics:
    """Per label: AUC, normalized entropy and calibration of the held-out candidates from
    TorchRec's metrics (``torchrec.metrics``, one task per label), over the ranks of ``group``,
    plus the mean log loss, the number of candidates (summed over the ranks) and GAUC (AUC per
    user, averaged: computed here, over every rank's candidates gathered). Every rank calls
    ``update`` with its own logits and labels [N, K] and the candidates' users, then ``compute``
    (a collective) with the others.

    The first label's figures are ``eval/auc``, ``eval/ne``, ...; with several labels each
    label's are also under ``eval/<label>/auc`` and so on."""

    def __init__(self, group: dist.ProcessGroup, batch_size: int, labels: list[str] | None = None) -> None:
        from torchrec.metrics.auc import AUCMetric
        from torchrec.metrics.calibration import CalibrationMetric
        from torchrec.metrics.metrics_config import RecTaskInfo
        from torchrec.metrics.ne import NEMetric

        self.labels = list(labels or ["click"])
        self.tasks = [EVAL_TASK if k == 0 else f"{EVAL_TASK}{k}" for k in range(len(self.labels))]
        tasks = [RecTaskInfo(name=t, label_name="label", prediction_name="prediction", weight_name="weight")
                 for t in self.tasks]
        common = dict(world_size=dist.get_world_size(group), my_rank=dist.get_rank(group), batch_size=batch_size,
                      tasks=tasks, window_size=WHOLE_SET, compute_on_all_ranks=True, process_group=group)
        self.metrics = {"auc": AUCMetric(**common), "ne": NEMetric(**common), "calibration": CalibrationMetric(**common)}
        self.group = group
        k = len(self.labels)
        self.sums = torch.zeros(k + 1, dtype=torch.float64)  # log loss per label, candidates
        self.seen: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (users, labels, logits) for GAUC

    def update(self, logits: torch.Tensor, labels: torch.Tensor, users: torch.Tensor | None = None) -> None:
        k = len(self.labels)
        logits = logits.detach().float().cpu().reshape(-1, k)
        labels = labels.detach().float().cpu().reshape(-1, k)
        if not logits.shape[0]:
            return
        inputs = {"predictions": {t: torch.sigmoid(logits[:, i]) for i, t in enumerate(self.tasks)},
                  "labels": {t: labels[:, i] for i, t in enumerate(self.tasks)},
                  "weights": {t: torch.ones_like(labels[:, 0]) for t in self.tasks}}
        for metric in self.metrics.values():
            metric.update(**inputs)
        loss = F.binary_cross_entropy_with_logits(logits.double(), labels.double(), reduction="none").sum(0)
        self.sums += torch.cat([loss, torch.tensor([float(logits.shape[0])], dtype=torch.float64)])
        if users is not None:
            self.seen.append((users.cpu().numpy().reshape(-1), labels.numpy(), logits.numpy()))

    def compute(self) -> dict:
        """The figures above and ``eval/samples`` (empty when no rank saw a candidate)."""
        sums = self.sums.clone()
        dist.all_reduce(sums, group=self.group)
        gathered: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, self.seen, group=self.group)
        seen = [part for rank in gathered for part in rank]
        values = {}
        for name, metric in self.metrics.items():
            out = metric.compute()
            for t in self.tasks:
                key = f"{name}-{t}|lifetime_{name}"
                values[name, t] = float(out[key] if key in out else out[f"{name}-{t}|window_{name}"])
        if sums[-1] == 0:
            return {}
        result = {}
        for i, (label, t) in enumerate(zip(self.labels, self.tasks)):
            figures = {"auc": round(values["auc", t], 6), "ne": round(values["ne", t], 6),
                       "calibration": round(values["calibration", t], 6),
                       "loss": round(float(sums[i] / sums[-1]), 6)}
            if seen:
                g, _ = gauc(np.concatenate([u for u, _, _ in seen]), np.concatenate([y[:, i] for _, y, _ in seen]),
                            np.concatenate([x[:, i] for _, _, x in seen]))
                figures["gauc"] = round(g, 6)
            if i == 0:
                result.update({f"eval/{name}": v for name, v in figures.items()})
            if len(self.labels) > 1:
                result.update({f"eval/{label}/{name}": v for name, v in figures.items()})
        result["eval/samples"] = int(sums[-1])
        return result


class MetricsLog:
    """Appends one JSON object per line to ``<run>/metrics.jsonl`` (written by the main rank only)
    and, with ``tensorboard``, hands the same records to a ``TensorBoardLog``.

    A launch that continues after ``start_step`` (a resume, a rejoining replica group) first
    rewinds metrics.jsonl to it, as the ledger does: each step keeps one record.
    """

    def __init__(self, run_dir: str, enabled: bool, start_step: int = 0, tensorboard: bool = False) -> None:
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.enabled = enabled
        self.tensorboard = None
        if enabled:
            rewind_jsonl(self.path, start_step)
            if tensorboard:
                self.tensorboard = TensorBoardLog(os.path.join(run_dir, TENSORBOARD_DIR), start_step)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self.tensorboard:
            self.tensorboard.write(record)

    def close(self) -> None:
        if self.tensorboard:
            self.tensorboard.close()


TENSORBOARD_DIR = "tensorboard"
TENSORBOARD_MISSING = "run.tensorboard: needs the tensorboard package (pip install tensorboard)"


def require_tensorboard():
    """TensorBoard's ``SummaryWriter``; a one-line ``ConfigError`` when the package is missing
    (the trainer asks before the run writes anything, so it fails before set-up)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(TENSORBOARD_MISSING) from None
    return SummaryWriter


class TensorBoardLog:
    """Every numeric value of a metrics.jsonl record as a TensorBoard scalar (tag: its key,
    global step: the record's ``step``), flushed at each record so a watching TensorBoard sees
    it at once.

    Event files from an earlier launch may hold steps after ``start_step``; the writer's purge
    step tells TensorBoard to hide them, as metrics.jsonl drops them.
    """

    def __init__(self, folder: str, start_step: int = 0) -> None:
        self.writer = require_tensorboard()(log_dir=folder, purge_step=start_step + 1)

    def write(self, record: dict) -> None:
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
