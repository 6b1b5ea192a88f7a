"""Leave-one-out ranking against the whole item table, with the table split over 2 gloo ranks,
agrees with a full sort of every item's score done here on one process: the target's rank
counts the items scoring above it, without the user's history (when left out) and the target."""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from freescale.data.batch import Batch, Samples
from freescale.model.output import StepOutput
from freescale.train.retrieval import evaluate_retrieval, rank_metrics
from helpers.spawn import run_ranks

pytestmark = pytest.mark.slow

ITEMS, DIM, USERS = 37, 5, 24  # 37 items over 2 ranks: 19 and 18


def table():
    g = torch.Generator().manual_seed(1)
    return torch.nn.functional.normalize(torch.randn(ITEMS, DIM, generator=g), dim=1)


def users():
    rng = np.random.default_rng(2)
    out = []
    for u in range(USERS):
        history = rng.choice(ITEMS, size=rng.integers(1, 9), replace=False)
        target = int(rng.integers(0, ITEMS))
        query = rng.normal(size=DIM).astype(np.float32)
        out.append((u, history.astype(np.int64), target, query))
    return out


def batches(mine):
    """One held-out batch per 4 users (the history ids, the target as the only candidate)."""
    out = []
    for at in range(0, len(mine), 4):
        part = mine[at:at + 4]
        lengths = np.array([len(h) for _, h, _, _ in part])
        samples = Samples(sample_ids=np.array([u for u, *_ in part]), user_ids=np.array([u for u, *_ in part]),
                          uih_lengths=lengths, uih_values=np.concatenate([h for _, h, _, _ in part]),
                          uih_timestamps=np.zeros(int(lengths.sum()), dtype=np.int64),
                          cand_counts=np.ones(len(part), dtype=np.int64),
                          cand_values=np.array([t for _, _, t, _ in part]),
                          cand_timestamps=np.zeros(len(part), dtype=np.int64),
                          labels=np.ones((len(part), 1), dtype=np.float32))
        out.append(Batch.from_samples(samples, at, 100))
    return out


def fake_model(queries):
    """The evaluation forward's contract: item vectors of the candidates, a query per sample."""
    vectors = table()

    def model(batch):
        n_uih = int(batch.uih_lengths.sum())
        cands = batch.seq_features.values()[n_uih:]
        q = torch.stack([torch.from_numpy(queries[int(s)]) for s in batch.sample_ids]) if n_uih else None
        out = StepOutput(torch.zeros(()), torch.zeros(len(cands), 1), batch.labels, batch.sample_ids,
                         batch.uih_lengths, batch.batch_index, batch.cand_counts, q, vectors[cands])
        return torch.zeros(()), out
    return model


def reference(exclude_history):
    vectors = table()
    ranks = []
    for _, history, target, query in users():
        scores = vectors @ torch.from_numpy(query)
        others = [i for i in range(ITEMS) if i != target and not (exclude_history and i in set(history.tolist()))]
        ranks.append(sum(1 for i in others if scores[i] > scores[target]))
    return np.array(ranks)


def _rank(rank, world, exclude_history, expected):
    everyone = users()
    mine = everyone[rank * USERS // world:(rank + 1) * USERS // world]
    queries = {u: q for u, _, _, q in everyone}
    got = evaluate_retrieval(fake_model(queries), batches(mine), num_items=ITEMS, ks=[1, 5, 10],
                             exclude_history=exclude_history, group=dist.group.WORLD, user_hash_size=100)
    assert got == expected


@pytest.mark.parametrize("exclude_history", [True, False])
def test_ranks_over_a_split_table_match_a_full_sort(exclude_history):
    expected = rank_metrics(reference(exclude_history), [1, 5, 10])
    assert expected != rank_metrics(reference(not exclude_history), [1, 5, 10])  # the history matters here
    run_ranks(2, _rank, exclude_history, expected)
