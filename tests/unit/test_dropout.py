"""Keyed dropout: a token's mask is a hash of (seed, its sample's stream position, its index,
the site, the feature), so a sample draws the same masks wherever it trains and new ones when
its stream position changes (another epoch); torch's generator is never drawn from."""

import numpy as np
import torch

from freescale.config import ModelConfig, TaskConfig
from freescale.data.batch import Batch, Samples
from freescale.data.synthetic import _mix
from freescale.model.dropout import keep_mask, mix, token_keys
from freescale.model.seqrec import build_task


def test_mix_is_splitmix64_bit_for_bit():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2**63 - 1, 1000, dtype=np.int64).astype(np.uint64) * np.uint64(3)  # the top bit set too
    got = mix(torch.from_numpy(x.view(np.int64))).numpy().view(np.uint64)
    np.testing.assert_array_equal(got, _mix(x))


def test_masks_keep_the_rate_and_differ_by_site_and_key():
    keys = token_keys(5, torch.arange(400), torch.full((400,), 10))
    keep = keep_mask(keys, 64, site=1, p=0.2)
    assert abs(keep.float().mean().item() - 0.8) < 0.01
    assert (keep != keep_mask(keys, 64, site=2, p=0.2)).float().mean() > 0.2  # sites independent
    other = token_keys(6, torch.arange(400), torch.full((400,), 10))  # another seed
    assert (keep != keep_mask(other, 64, site=1, p=0.2)).float().mean() > 0.2
    assert len(set(keys.tolist())) == len(keys)


def samples(ids, positions, lengths):
    """Samples whose contents are a function of their id (items, times), at stream ``positions``."""
    n = len(ids)
    items = [np.random.default_rng(i).integers(0, 50, L + 2) for i, L in zip(ids, lengths)]
    return Samples(sample_ids=np.array(ids), user_ids=np.array(ids), uih_lengths=np.array(lengths),
                   uih_values=np.concatenate([x[:-2] for x in items]),
                   uih_timestamps=np.concatenate([np.arange(L) * 60 for L in lengths]),
                   cand_counts=np.full(n, 2), cand_values=np.concatenate([x[-2:] for x in items]),
                   cand_timestamps=np.full(2 * n, 10**6), labels=np.ones((2 * n, 1), np.float32),
                   stream_positions=np.array(positions))


def logits_of(task, s):
    """The task's training forward over ``s`` (rows: the item ids' fixed random vectors)."""
    table = torch.randn(50, 16, generator=torch.Generator().manual_seed(2))
    b = Batch.from_samples(s, 0, 100)
    n = int(b.uih_lengths.sum())
    rows = table[b.item_ids]
    _, out = task(rows[:n], rows[n:], None, b.item_ids, b.uih_lengths, b.cand_counts, b.uih_timestamps,
                  b.cand_timestamps, b.labels, b.sample_ids, b.batch_index, b.loss_scale, b.stream_positions)
    return out.logits


def task():
    cfg = ModelConfig(kind="hstu", embedding_dim=16, num_layers=2, num_heads=2, dropout=0.3, user_features=False,
                      mlp_dims=[8])
    torch.manual_seed(0)
    return build_task(cfg, max_uih_len=32, task_cfg=TaskConfig(), max_candidates=2, seed=3).train()


def test_a_sample_draws_the_same_masks_in_any_batch_and_new_ones_at_another_position():
    t = task()
    alone = logits_of(t, samples([7, 8, 9], [70, 80, 90], [5, 12, 3]))[2:4]  # sample 8's candidates
    moved = logits_of(t, samples([1, 8, 2, 4], [10, 80, 20, 40], [9, 12, 1, 30]))[2:4]
    assert torch.equal(alone, moved)
    later = logits_of(t, samples([7, 8, 9], [70, 80 + 1000, 90], [5, 12, 3]))[2:4]  # next epoch
    assert not torch.equal(alone, later)
    t.eval()
    assert torch.equal(logits_of(t, samples([7, 8, 9], [70, 80, 90], [5, 12, 3]))[2:4],
                       logits_of(t, samples([7, 8, 9], [70, 1080, 90], [5, 12, 3]))[2:4])  # no dropout in eval


def test_training_never_draws_from_torchs_generator():
    t = task()
    state = torch.get_rng_state()
    logits_of(t, samples([7, 8, 9], [70, 80, 90], [5, 12, 3]))
    assert torch.equal(state, torch.get_rng_state())
