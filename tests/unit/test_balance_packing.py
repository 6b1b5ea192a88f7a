"""The balancer's wire format, in one process: every rank's plan and packed buffer, an
all-to-all played by slicing, and the unpacked samples against the partition's."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from freescale.balance.balancer import _META, Balancer, _Exchange, _pack, _unpack
from freescale.balance.cost import CostModel
from freescale.balance.partition import PARTITIONS
from freescale.config import SyntheticDataConfig
from freescale.data.batch import SideLayout
from freescale.data.sample_files import SideFeature
from freescale.data.synthetic import SyntheticSource


def source(num_labels=2, side=False):
    cfg = SyntheticDataConfig(median_uih_len=16, tail_prob=0.1, tail_min_len=200, num_labels=num_labels,
                              user_features=side, item_features=side)
    return SyntheticSource(cfg, seed=7, split="train", min_uih_len=1, max_uih_len=3000, num_candidates=3)


def assert_samples_equal(a, b):
    assert a.side_layout == b.side_layout
    for name in a.__dataclass_fields__:
        if name == "side_layout":
            continue
        got, want = getattr(a, name), getattr(b, name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(got, want, err_msg=name)


def sizes_of(part, num_labels):
    """What stage I gathers of ``part``: (L, C, K, user slots, item slots) per sample."""
    each = lambda v: np.full(len(part), v)  # noqa: E731
    return np.stack([part.uih_lengths, part.cand_counts, each(num_labels), each(part.side_layout.user_width),
                     each(part.side_layout.item_width)], axis=1)


def with_side_features(s):
    """``s`` with side features whose every slot encodes its own row and column (a mix-up shows),
    some unused: a 2-slot and a 1-slot user feature, a 3-slot item feature."""
    layout = SideLayout(user=(SideFeature("a", 1000, 2), SideFeature("b", 1000, 1)), item=(SideFeature("c", 10**6, 3),))
    def slots(rows, width, base):
        value = base + 10 * np.arange(rows)[:, None] + np.arange(width)[None, :]
        return np.where((np.arange(rows)[:, None] + np.arange(width)[None, :]) % 3 == 2, -1, value)
    L, C = int(s.uih_lengths.sum()), int(s.cand_counts.sum())
    return dataclasses.replace(s, user_side=slots(len(s), 3, 0), uih_side=slots(L, 3, 100_000),
                               cand_side=slots(C, 3, 500_000), side_layout=layout)


@pytest.mark.parametrize("side", [False, True], ids=["plain", "side-features"])
def test_pack_unpack_round_trips_times_and_2d_labels(side):
    s = source().samples_at(np.arange(10))
    if side:
        s = with_side_features(s)
    s.stream_positions = s.sample_ids + 12345  # a later epoch's positions: they travel too
    counts = np.array([4, 0, 6])
    buffer = _pack(s, counts)
    offset, bounds = 0, np.concatenate([[0], np.cumsum(counts)])
    for j in range(3):
        part = s.select(np.arange(bounds[j], bounds[j + 1]))
        # Words by hand: meta, ids and times of events and candidates, 2 labels, then the side slots.
        L, C, n = int(part.uih_lengths.sum()), int(part.cand_counts.sum()), len(part)
        words = _META * n + 2 * L + 4 * C + (3 * n + 3 * L + 3 * C if side else 0)
        assert_samples_equal(_unpack(buffer[offset:offset + words], sizes_of(part, 2), 2, s.side_layout), part)
        offset += words
    assert offset == len(buffer)


def _rebalanced(world, partition, num_labels, batch=16, side=False):
    """Each rank's received samples, through plan, pack and unpack; and the global batch."""
    global_samples = source(num_labels).samples_at(np.arange(world * batch))
    if side:
        global_samples = with_side_features(global_samples)
    locals_ = [global_samples.select(np.arange(r * batch, (r + 1) * batch)) for r in range(world)]
    balancers = [Balancer(partition, CostModel(), SimpleNamespace(rank=r, world_size=world), user_hash_size=100,
                          normalize_loss=False) for r in range(world)]
    sizes = np.concatenate([sizes_of(s, s.labels.shape[1]) for s in locals_])
    plans = [b.plan(sizes, batch) for b in balancers]
    sent = []
    for r in range(world):
        buffer = _pack(locals_[r].select(plans[r].send_order), plans[r].send_counts)
        assert len(buffer) == sum(plans[r].input_splits)
        sent.append(np.split(buffer, np.cumsum(plans[r].input_splits)[:-1]))
    received = []
    for r in range(world):
        incoming = np.concatenate([sent[src][r] for src in range(world)])
        assert len(incoming) == sum(plans[r].output_splits)
        handle = SimpleNamespace(wait=lambda incoming=incoming: torch.from_numpy(incoming))
        received.append(_Exchange(handle, plans[r], global_samples.side_layout).wait())
    return global_samples, received


@pytest.mark.parametrize("side", [False, True], ids=["plain", "side-features"])
def test_all_to_all_delivers_the_partition_with_times_and_labels(side):
    for num_labels in (1, 2):
        for partition in ("karmarkar_karp", "vbs", "zigzag"):
            global_samples, received = _rebalanced(3, partition, num_labels, side=side)
            costs = CostModel().cost(global_samples.uih_lengths, global_samples.cand_counts)
            for r, got in enumerate(received):
                assert_samples_equal(got, global_samples.select(PARTITIONS[partition](costs, 3)[r]))
                assert got.labels.shape[1] == num_labels


def test_each_rank_solving_only_its_hosts_delivers_the_whole_partition():
    """hierarchical on 20 ranks (hosts of 8, 8 and 4): every rank plans from its own view (its
    host and the hosts its samples go to), and what arrives is the whole solve's parts."""
    global_samples, received = _rebalanced(20, "hierarchical", 1, batch=12)
    costs = CostModel().cost(global_samples.uih_lengths, global_samples.cand_counts)
    parts = PARTITIONS["hierarchical"](costs, 20)
    owner = np.concatenate([np.full(len(p), r) for r, p in enumerate(parts)])[np.argsort(np.concatenate(parts))]
    assert (owner // 8 != np.arange(20 * 12) // 12 // 8).any()  # samples cross hosts
    for r, got in enumerate(received):
        assert_samples_equal(got, global_samples.select(parts[r]))
