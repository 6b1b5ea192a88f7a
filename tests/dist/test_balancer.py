"""The balancer on 2 and 4 gloo ranks: exactly the partition's samples, payload intact."""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from freescale.balance.balancer import Balancer
from freescale.balance.cost import CostModel
from freescale.balance.partition import PARTITIONS
from freescale.config import SyntheticDataConfig
from freescale.data.synthetic import SyntheticSource
from freescale.transport.torch_dist import TorchDistTransport
from helpers.spawn import run_ranks

pytestmark = pytest.mark.slow

B = 24


def source(num_labels=1):
    # (Side features on: a user's and every item's slots travel with the sample too.)
    cfg = SyntheticDataConfig(median_uih_len=16, tail_prob=0.1, tail_min_len=200, tail_alpha=1.0, num_labels=num_labels,
                              user_features=True, item_features=True)
    return SyntheticSource(cfg, seed=7, split="train", min_uih_len=1, max_uih_len=3000, num_candidates=3)


def assert_samples_equal(a, b):
    for name in a.__dataclass_fields__:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def _check_rebalance(rank, world, partition):
    src = source(num_labels=2)  # times and [candidates, 2] labels travel with the ids
    balancer = Balancer(partition, CostModel(), TorchDistTransport(), user_hash_size=1000,
                        normalize_loss=partition == "vbs")
    for k in range(3):
        global_samples = src.samples_at(np.arange(k * world * B, (k + 1) * world * B))
        local = global_samples.select(np.arange(rank * B, (rank + 1) * B))
        got, scale = balancer.rebalance(local)
        costs = CostModel().cost(global_samples.uih_lengths, global_samples.cand_counts)
        expected = global_samples.select(PARTITIONS[partition](costs, world)[rank])
        assert_samples_equal(got, expected)
        if partition == "vbs":
            assert scale == pytest.approx(world * expected.cand_counts.sum() / global_samples.cand_counts.sum())
        else:
            assert scale == 1.0
    # The read-ahead yields the same batches, in order. Its work is a profiler phase (``phase``
    # makes the torch.profiler range: tests/unit/test_progress.py), on the balancer's thread.
    import threading

    import freescale.balance.balancer as module

    seen, real = [], module.phase
    module.phase = lambda kind: seen.append((kind, threading.current_thread().name)) or real(kind)
    try:
        batches = balancer.batches((k, src.samples_at(np.arange(k * world * B + rank * B,
                                                                k * world * B + (rank + 1) * B)))
                                   for k in range(100))
        first = next(batches)
    finally:
        module.phase = real
    assert seen and set(seen) == {("balance", "freescale-balancer")}
    for k in range(4):
        batch = first if k == 0 else next(batches)
        global_samples = src.samples_at(np.arange(k * world * B, (k + 1) * world * B))
        costs = CostModel().cost(global_samples.uih_lengths, global_samples.cand_counts)
        expected = global_samples.select(PARTITIONS[partition](costs, world)[rank])
        assert int(batch.batch_index) == k
        np.testing.assert_array_equal(batch.sample_ids.numpy(), expected.sample_ids)
        np.testing.assert_array_equal(batch.seq_features.values().numpy(),
                                      np.concatenate([expected.uih_values, expected.cand_values]))
        np.testing.assert_array_equal(batch.labels.numpy(), expected.labels)
        np.testing.assert_array_equal(batch.uih_timestamps.numpy(), expected.uih_timestamps)
        np.testing.assert_array_equal(batch.cand_timestamps.numpy(), expected.cand_timestamps)
    balancer.close()  # (its thread issues on the default group too: stopped before the next collective)
    # Every sample of the global batch landed on exactly one rank.
    ids = torch.from_numpy(got.sample_ids)
    counts = torch.tensor([len(ids)])
    all_counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(all_counts, counts)
    assert sum(int(c) for c in all_counts) == world * B


def _check_all_partitions(rank, world):
    for partition in ("karmarkar_karp", "vbs", "zigzag", "contiguous", "hierarchical"):
        _check_rebalance(rank, world, partition)


@pytest.mark.parametrize("world", [2, 4])
def test_balancer_delivers_the_partition(world):
    run_ranks(world, _check_all_partitions)


def _stop_together(rank, world):
    """Rank 1's loader is slow, so when both ranks close after taking the same batches their
    threads are at different places; both still stop after the same batch (they read the same
    number of local batches), and no collective is left on the group that one rank issued and
    the other never did (the next collective on it lines up)."""
    import time

    src = source()
    pulled = []

    def local():
        for k in range(100):
            if rank == 1:
                time.sleep(0.05)
            pulled.append(k)
            yield k, src.samples_at(np.arange((k * world + rank) * B, (k * world + rank + 1) * B))

    balancer = Balancer("greedy", CostModel(), TorchDistTransport(), user_hash_size=1000, normalize_loss=False,
                        read_ahead=3)
    batches = balancer.batches(local())
    assert [int(next(batches).batch_index) for _ in range(2)] == [0, 1]
    balancer.close()
    counts = [None] * world
    dist.all_gather_object(counts, len(pulled))
    assert counts == [2 + 3] * world


def test_closing_stops_every_ranks_thread_after_the_same_batch():
    run_ranks(2, _stop_together)


def _model():
    from freescale.config import EmbeddingConfig, ModelConfig
    from freescale.model.seqrec import SeqRecModel

    torch.manual_seed(0)
    cfg = ModelConfig(embedding_dim=8, num_layers=1, num_heads=2, mlp_dims=[8], user_hash_size=1000)
    return SeqRecModel(cfg, EmbeddingConfig(), num_items=source().num_items, max_uih_len=3000,
                       device=torch.device("cpu"))


def _vbs_grads(rank, world, out_path):
    """DDP gradients of the real model on the batch the real vbs Balancer gives this rank."""
    src = source()
    balancer = Balancer("vbs", CostModel(), TorchDistTransport(), user_hash_size=1000, normalize_loss=True)
    local = ((k, src.samples_at(np.arange((k * world + rank) * B, (k * world + rank + 1) * B))) for k in range(3))
    batch = next(balancer.batches(local))  # global batch 0
    balancer.close()
    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    loss, _ = ddp(batch)
    loss.backward()
    counts = [None] * world
    dist.all_gather_object(counts, int(batch.labels.numel()))
    if rank == 0:
        torch.save({"counts": counts, "grads": {n: p.grad for n, p in model.named_parameters()}}, out_path)


def test_vbs_training_follows_the_mean_loss_of_the_global_batch(tmp_path):
    """Unequal shares, scaled by the balancer, averaged by DDP: the gradient of one process on
    the whole global batch. Without the balancer's loss scale the ranks' means weigh equally."""
    out = tmp_path / "grads.pt"
    run_ranks(2, _vbs_grads, str(out))
    distributed = torch.load(out)
    assert len(set(distributed["counts"])) == 2  # vbs gave the ranks unequal candidate counts
    from freescale.data.batch import Batch

    whole = Batch.from_samples(source().samples_at(np.arange(2 * B)), 0, 1000)
    model = _model()
    loss, _ = model(whole)
    loss.backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(distributed["grads"][name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
