"""The stateful loader: this rank's slice of consecutive global batches.

Global batch ``k`` is the ``ranks x batch_size`` samples at stream positions
``k*G .. (k+1)*G - 1`` (``G`` = global batch size; a finite source wraps around into the
next epoch). Rank ``r`` takes the contiguous ``r``-th slice, which is what a
``DistributedSampler`` split does and is the baseline the balancer re-partitions.

The cursor is the index of the next global batch, so it is the same on every rank and a
resumed run continues exactly where the checkpoint left off. Under the replica layer each
replica group trains its own shard of the stream: replica ``s`` of ``S`` takes global batches
``s, s + S, s + 2S, ...``, and its cursor counts the batches of its shard. Pipelines read batches ahead of
training; the trainer therefore checkpoints the batch after the last one *trained*
(``freescale.train.state.DataCursor``), not the loader's own read position.
"""

from __future__ import annotations

from typing import Iterator, Protocol

import numpy as np

from freescale.config import DataConfig, TaskConfig
from freescale.data.batch import Batch, Samples, SideLayout
from freescale.data.parquet_source import ParquetSource
from freescale.data.readers import RatingsSource, read_ratings
from freescale.data.sample_files import SampleFileError
from freescale.data.synthetic import SyntheticSource


class SampleSource(Protocol):
    num_items: int
    num_samples: int | None
    """Samples in the split, or None for an infinite stream."""
    side_layout: SideLayout
    """The side features its samples carry (``SideLayout()``: none)."""

    def samples_at(self, positions: np.ndarray) -> Samples: ...

    def item_side(self, item_ids: np.ndarray) -> np.ndarray:
        """int64 [len(item_ids), side_layout.item_width]: the items' side features (retrieval's
        evaluation ranks every item of the table, with its features)."""


def build_sources(cfg: DataConfig, seed: int, task: TaskConfig | None = None) -> tuple[SampleSource, SampleSource]:
    """The (train, eval) sources the config names, with the samples of ``task`` (default: ranking)."""
    task = task or TaskConfig()
    common = dict(min_uih_len=cfg.min_uih_len, max_uih_len=cfg.max_uih_len, num_candidates=cfg.num_candidates,
                  task=task.kind, num_negatives=task.num_negatives)
    if cfg.source == "synthetic":
        return tuple(SyntheticSource(cfg.synthetic, seed=seed, split=s, **common) for s in ("train", "eval"))
    if cfg.source == "parquet":
        return tuple(parquet_sources(cfg.path, cfg, seed, task))
    if cfg.source == "ml100k":  # prepared once per settings, then read like any prepared dataset
        from freescale.data.prepare import prepared_ml100k

        return tuple(parquet_sources(prepared_ml100k(cfg, task), cfg, seed, task))
    log = read_ratings(cfg.ratings.path)
    return tuple(
        RatingsSource(log, split=s, positive_rating=cfg.ratings.positive_rating, more_labels=tuple(cfg.ratings.more_labels),
                      holdout_fraction=cfg.ratings.holdout_fraction, seed=seed, window_stride=task.window_stride,
                      **common)
        for s in ("train", "eval")
    )


def parquet_sources(folder: str, cfg: DataConfig, seed: int, task: TaskConfig) -> list[ParquetSource]:
    """The train and eval splits of a prepared dataset, checked against the run's settings: the
    task and its retrieval windows are fixed when the samples are cut, so they must agree."""
    sources = [ParquetSource(folder, split, task=task.kind, num_negatives=task.num_negatives, seed=seed,
                             max_uih_len=cfg.max_uih_len, cache_row_groups=cfg.cache_row_groups)
               for split in ("train", "eval")]
    prepared = sources[0].manifest
    if task.kind == "retrieval" and task.window_stride != prepared.window_stride:
        raise SampleFileError(f"{folder}: prepared with window_stride {prepared.window_stride}, the run's "
                              f"task.window_stride is {task.window_stride} (the loss mask needs the windows the samples have)")
    return sources


class BatchLoader:
    """Iterates this rank's local batches of global batches ``next_batch, next_batch+1, ...``."""

    def __init__(self, source: SampleSource, *, batch_size: int, rank: int, world_size: int,
                 user_hash_size: int, next_batch: int = 0, shard: int = 0, shards: int = 1) -> None:
        self.source = source
        self.shard = shard
        self.shards = shards
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.user_hash_size = user_hash_size
        self.next_batch = next_batch

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    def global_positions(self, batch_index: int) -> np.ndarray:
        """Stream positions of global batch ``batch_index`` (all ranks, rank-major)."""
        pos = batch_index * self.global_batch_size + np.arange(self.global_batch_size, dtype=np.int64)
        return pos if self.source.num_samples is None else pos % self.source.num_samples

    def local_samples(self, batch_index: int) -> Samples:
        mine = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        samples = self.source.samples_at(self.global_positions(batch_index)[mine])
        # Positions counted across epochs (a finite source's wrap left out): the dropout key.
        samples.stream_positions = (batch_index * self.global_batch_size
                                    + np.arange(self.global_batch_size, dtype=np.int64))[mine]
        return samples

    def batch_at(self, position: int) -> int:
        """The global batch index of this shard's ``position``-th batch."""
        return position * self.shards + self.shard

    def position_after(self, batch_index: int) -> int:
        """The cursor that follows global batch ``batch_index`` of this shard."""
        return (int(batch_index) - self.shard) // self.shards + 1

    def iter_samples(self) -> Iterator[tuple[int, Samples]]:
        """(global batch index, this rank's samples), advancing the cursor."""
        while True:
            k = self.batch_at(self.next_batch)
            self.next_batch += 1
            yield k, self.local_samples(k)

    def __iter__(self) -> Iterator[Batch]:
        for k, samples in self.iter_samples():
            yield Batch.from_samples(samples, k, self.user_hash_size)

    def state_dict(self) -> dict:
        return {"next_batch": self.next_batch}

    def load_state_dict(self, state: dict) -> None:
        self.next_batch = int(state["next_batch"])


def eval_batches(source: SampleSource, *, num_samples: int, batch_size: int, rank: int, world_size: int,
                 user_hash_size: int) -> list[Batch]:
    """This rank's share of the first ``num_samples`` held-out samples, in batches.

    Every rank gets the same number of samples and batches, since each forward through the
    sharded model is a collective. A source that knows its users' whole timelines (a ratings
    log's ``seen_items``) attaches each sample's earlier items (``Batch.seen_items``).
    """
    available = num_samples if source.num_samples is None else min(num_samples, source.num_samples)
    per_rank = available // world_size
    start = rank * per_rank
    batches = []
    for i, lo in enumerate(range(0, per_rank, batch_size)):
        pos = np.arange(start + lo, start + min(lo + batch_size, per_rank), dtype=np.int64)
        batch = Batch.from_samples(source.samples_at(pos), i, user_hash_size)
        if hasattr(source, "seen_items"):
            batch.seen_items = source.seen_items(pos)
        batches.append(batch)
    return batches
