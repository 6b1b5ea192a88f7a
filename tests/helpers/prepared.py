"""Prepared datasets for tests, written with the format's writer, and what they hold read back
with pyarrow alone (the reference the trainer's ledger is checked against)."""

from __future__ import annotations

import glob
import os

import numpy as np

from freescale.config import load_config


def write_synthetic_prepared(folder, config, overrides, n_train: int, n_eval: int = 64, rows_per_group: int = 24) -> str:
    """The config's synthetic samples (``n_train`` + ``n_eval``) as a prepared dataset in ``folder``."""
    from freescale.data.features import label_names
    from freescale.data.loader import build_sources
    from freescale.data.sample_files import DatasetWriter, Manifest, sample_schema, samples_table

    cfg = load_config(config, list(overrides))
    sources = build_sources(cfg.data, cfg.run.seed, task=cfg.task)
    labels = label_names(cfg.data, cfg.task.kind)
    with DatasetWriter(str(folder)) as out:
        for split, src, n in zip(("train", "eval"), sources, (n_train, n_eval)):
            writer = out.split(split, sample_schema(labels, [], False), rows_per_group=rows_per_group, rows_per_file=50)
            writer.write(samples_table(src.samples_at(np.arange(n)), labels))
        return out.commit(Manifest(task=cfg.task.kind, num_items=sources[0].num_items, num_users=cfg.data.synthetic.num_users,
                                   min_uih_len=cfg.data.min_uih_len, max_uih_len=cfg.data.max_uih_len,
                                   num_candidates=cfg.data.num_candidates, labels=labels))


def train_ids(folder) -> np.ndarray:
    """The train split's sample ids in file order, read with pyarrow."""
    import pyarrow.parquet as pq

    files = sorted(glob.glob(os.path.join(str(folder), "train", "part-*.parquet")))
    return np.concatenate([pq.read_table(f, columns=["sample_id"]).column("sample_id").to_numpy() for f in files])


def batches_of(ids: np.ndarray, batches, global_batch: int) -> dict[int, list[int]]:
    """Each global batch's sample ids: consecutive positions of the split, wrapping into the next epoch."""
    return {int(k): ids[(int(k) * global_batch + np.arange(global_batch)) % len(ids)].tolist() for k in batches}
