"""Two ranks' worth of small batches over FreeScale's own tables, and the pipelines built over
them as the tests drive them (the prioritized pipeline against ``sync``, the sync budget)."""

import numpy as np
import torch

from freescale.config import load_config
from freescale.data.batch import Batch, Samples
from freescale.distributed import Topology
from freescale.embedding.pipeline import build_owned_model
from freescale.model.sharding import build_dense_optimizer
from freescale.train.pipelines import build_pipeline
from helpers.launch import QUICKSTART

ITEMS = 64  # rows 0..31 on rank 0, 32..63 on rank 1
USERS = 16
SMALL = ["--model.embedding_dim=8", "--model.num_heads=2", "--model.num_layers=1", "--model.mlp_dims=[8]",
         f"--model.user_hash_size={USERS}", "--data.max_uih_len=16", "--embedding.lr=0.5", "--train.lr=0.01"]


def _samples(rng, pool, n, first_id, uih_len=(0, 6), users=np.arange(USERS)):
    lengths = rng.integers(uih_len[0], uih_len[1] + 1, n)
    return Samples(
        sample_ids=np.arange(first_id, first_id + n, dtype=np.int64),
        user_ids=rng.choice(users, n).astype(np.int64),
        uih_lengths=lengths.astype(np.int64),
        uih_values=rng.choice(pool, int(lengths.sum())).astype(np.int64),
        uih_timestamps=np.arange(int(lengths.sum()), dtype=np.int64),
        cand_counts=np.full(n, 2, dtype=np.int64),
        cand_values=rng.choice(pool, 2 * n).astype(np.int64),
        cand_timestamps=np.full(2 * n, int(lengths.sum()), dtype=np.int64),
        labels=(rng.random((2 * n, 1)) < 0.5).astype(np.float32),
    )


def batches_of(rank):
    """26 batches per rank mixing every case: no row in common with the previous batch (even and
    odd rows, and users, alternate), the same rows again, empty histories, ids only rank 0 owns, any rows."""
    rng = np.random.default_rng(100 + rank)
    evens, odds = np.arange(0, ITEMS, 2), np.arange(1, ITEMS, 2)
    cases = (["disjoint"] * 4 + ["same"] * 4 + ["empty_uih"] * 3 + ["one_owner"] * 3 + ["any"] * 4
             + ["disjoint"] * 2 + ["same"] * 2 + ["any"] * 4)
    batches, previous = [], None
    for k, case in enumerate(cases):
        if case == "disjoint":
            s = _samples(rng, evens if k % 2 else odds, 6, 1000 * k + 10 * rank, users=(evens if k % 2 else odds) % USERS)
        elif case == "same" and previous is not None:
            s = previous
        elif case == "empty_uih":
            s = _samples(rng, np.arange(ITEMS), 5, 1000 * k + 10 * rank, uih_len=(0, 0))
        elif case == "one_owner":
            s = _samples(rng, np.arange(ITEMS // 2), 6, 1000 * k + 10 * rank)
        else:
            s = _samples(rng, np.arange(ITEMS), int(rng.integers(3, 8)), 1000 * k + 10 * rank)
        previous = s
        batches.append(Batch.from_samples(s, k, USERS))
    return batches




def build(mode, rank, world, transport_kind, timeline, device="cpu", overrides=()):
    """(model, optimizer, pipeline) of ``mode`` over this rank's share of the small tables
    (``overrides``: more config overrides, e.g. ``--transport.lanes=1``)."""
    cfg = load_config(QUICKSTART, [*SMALL, f"--transport.kind={transport_kind}", "--transport.timeout_s=30",
                                   *overrides])
    topo = Topology(rank=rank, world_size=world, local_rank=rank, local_world_size=world)
    torch.manual_seed(0)
    model = build_owned_model(cfg, num_items=ITEMS, max_uih_len=cfg.data.max_uih_len, topology=topo, seed=7,
                              device=device)
    optimizer = build_dense_optimizer(model.task, cfg.train)
    pipeline = build_pipeline(mode, model, optimizer, torch.device(device), timeline, group=topo.pg,
                              transport_cfg=cfg.transport)
    return model, optimizer, pipeline


def train_through(pipeline, batches) -> list[float]:
    """Every step's loss until the pipeline has trained the last of ``batches`` (an iterator:
    ``progress`` raises StopIteration once it is spent and nothing is left in flight)."""
    losses = []
    try:
        while True:
            losses.append(pipeline.progress(batches).loss.item())
    except StopIteration:
        return losses
