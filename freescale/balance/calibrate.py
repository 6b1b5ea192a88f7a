"""``freescale calibrate``: fit the cost model on the configured model and this machine.

For each point of a grid of (UIH length L, candidates C) a batch of identical-size samples
goes through forward and backward of the real model (unsharded, one process, the rank's
thread count, on the run's device: ``run.device``; on a GPU the device is synchronized
before each time is read, so the time is the kernels', not their launches'); the median time over repetitions divided by the batch size is the measured
per-sample cost. ``fit_cost_model`` then fits ``a*L + b*L^2 + c*C + d`` by least squares.
With ``model.side_features`` the model reads them, and every slot of the samples holds a value
(the most lookups a row can cost).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from freescale.balance.cost import CostModel, fit_cost_model
from freescale.config import ExperimentConfig
from freescale.data.batch import Batch, Samples, SideLayout
from freescale.data.features import label_names
from freescale.device import Streams
from freescale.distributed import resolve_device
from freescale.progress import bar, say
from freescale.model.seqrec import SeqRecModel, task_settings
from freescale.model.side import side_specs


def default_grid(max_uih_len: int, num_candidates: int) -> tuple[list[int], list[int]]:
    lengths = sorted({int(x) for x in np.geomspace(4, max_uih_len, 8).round()})
    candidates = sorted({1, num_candidates, 4 * num_candidates})
    return lengths, candidates


REQUEST_TIME = 1_700_000_000  # seconds; the calibration batches' histories end a minute apart before it


def _batch(n: int, L: int, C: int, num_items: int, rng: np.random.Generator, user_hash_size: int,
           num_labels: int = 1, layout: SideLayout = SideLayout()) -> Batch:
    def side(rows: int, features) -> np.ndarray | None:
        """Every slot of every feature holding a value."""
        if not features:
            return None
        return np.concatenate([rng.integers(0, f.num_values, (rows, f.max_values)) for f in features], axis=1)

    samples = Samples(
        sample_ids=np.arange(n, dtype=np.int64), user_ids=rng.integers(0, 1 << 30, n),
        uih_lengths=np.full(n, L, dtype=np.int64), uih_values=rng.integers(0, num_items, n * L),
        uih_timestamps=np.tile(REQUEST_TIME - 60 * np.arange(L, 0, -1, dtype=np.int64), n),
        cand_counts=np.full(n, C, dtype=np.int64), cand_values=rng.integers(0, num_items, n * C),
        cand_timestamps=np.full(n * C, REQUEST_TIME, dtype=np.int64),
        labels=rng.integers(0, 2, (n * C, num_labels)).astype(np.float32),
        user_side=side(n, layout.user), uih_side=side(n * L, layout.item), cand_side=side(n * C, layout.item),
        side_layout=layout,
    )
    return Batch.from_samples(samples, 0, user_hash_size)


def calibrate(cfg: ExperimentConfig, *, repeats: int = 5, tokens_per_batch: int = 16384, log=print) -> CostModel:
    torch.set_num_threads(cfg.run.threads or 1)
    torch.manual_seed(cfg.run.seed)
    num_items = cfg.data.synthetic.num_items if cfg.data.source == "synthetic" else _ratings_items(cfg)
    device = resolve_device(cfg.run.device, 0)
    streams = Streams(device)
    rng = np.random.default_rng(cfg.run.seed)
    candidates_per_sample = 1 + cfg.task.num_negatives if cfg.task.kind == "retrieval" else cfg.data.num_candidates
    lengths, candidates = default_grid(cfg.data.max_uih_len, candidates_per_sample)
    # (HSTU's ranking appends the candidates to the history: its sequences reach L + C.)
    layout = _side_layout(cfg)
    model = SeqRecModel(cfg.model, cfg.embedding, num_items=num_items,
                        **{**task_settings(cfg), "max_candidates": max(candidates)}, device=device,
                        side_specs=side_specs(cfg.model, layout))
    num_labels = len(label_names(cfg.data, cfg.task.kind))
    rows = []
    total = len(lengths) * len(candidates)
    points = bar(total=total, desc="calibrate", unit="point")
    for i, L in enumerate(lengths):
        n = int(np.clip(tokens_per_batch // L, 1, cfg.data.batch_size))
        for C in candidates:
            batch = _batch(n, L, C, num_items, rng, cfg.model.user_hash_size, num_labels, layout).to(device)
            times = []
            for rep in range(repeats + 1):
                streams.synchronize()
                t0 = time.perf_counter()
                loss, _ = model(batch)
                loss.backward()
                model.zero_grad(set_to_none=True)
                streams.synchronize()
                if rep:  # the first run warms caches and allocators
                    times.append(time.perf_counter() - t0)
            per_sample = float(np.median(times)) / n
            rows.append((L, C, per_sample))
            points.update()
            message = f"[calibrate {len(rows)}/{total}] L={L:>6} C={C:>3} batch={n:>4}: {1e3 * per_sample:.4f} ms/sample"
            if log is print:
                say(points, message)  # above the bar when there is one
            else:
                log(message)
    points.close()
    L, C, y = map(np.array, zip(*rows))
    info = {"grid": [[int(a), int(b), float(c)] for a, b, c in rows], "threads": torch.get_num_threads(),
            "device": device.type,
            "model": {"kind": cfg.model.kind, "task": cfg.task.kind, "embedding_dim": cfg.model.embedding_dim,
                      "num_layers": cfg.model.num_layers, "num_heads": cfg.model.num_heads}}
    return fit_cost_model(L, C, y, info)


def _side_layout(cfg: ExperimentConfig) -> SideLayout:
    """The side features of the training source (read only when the model uses some)."""
    if not cfg.model.side_features:
        return SideLayout()
    from freescale.data.loader import build_sources

    return build_sources(cfg.data, cfg.run.seed, task=cfg.task)[0].side_layout


def _ratings_items(cfg: ExperimentConfig) -> int:
    from freescale.data.ml100k import ensure_ml100k
    from freescale.data.readers import read_ratings

    path = ensure_ml100k(cfg.data.ratings.cache) if cfg.data.source == "ml100k" else cfg.data.ratings.path
    return read_ratings(path).num_items
