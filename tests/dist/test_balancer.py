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

B = 24


def source():
    cfg = SyntheticDataConfig(median_uih_len=16, tail_prob=0.1, tail_min_len=200, tail_alpha=1.0)
    return SyntheticSource(cfg, seed=7, split="train", min_uih_len=1, max_uih_len=3000, num_candidates=3)


def assert_samples_equal(a, b):
    for name in a.__dataclass_fields__:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def _check_rebalance(rank, world, partition):
    src = source()
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
    # The prefetching iterator yields the same batches, in order.
    batches = balancer.batches((k, src.samples_at(np.arange(k * world * B + rank * B, k * world * B + (rank + 1) * B)))
                               for k in range(100))
    for k in range(4):
        batch = next(batches)
        global_samples = src.samples_at(np.arange(k * world * B, (k + 1) * world * B))
        costs = CostModel().cost(global_samples.uih_lengths, global_samples.cand_counts)
        expected = global_samples.select(PARTITIONS[partition](costs, world)[rank])
        assert int(batch.batch_index) == k
        np.testing.assert_array_equal(batch.sample_ids.numpy(), expected.sample_ids)
        np.testing.assert_array_equal(batch.seq_features.values().numpy(),
                                      np.concatenate([expected.uih_values, expected.cand_values]))
        np.testing.assert_array_equal(batch.labels.numpy(), expected.labels)
    # Every sample of the global batch landed on exactly one rank.
    ids = torch.from_numpy(got.sample_ids)
    counts = torch.tensor([len(ids)])
    all_counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(all_counts, counts)
    assert sum(int(c) for c in all_counts) == world * B


def _check_all_partitions(rank, world):
    for partition in ("karmarkar_karp", "vbs", "zigzag", "contiguous"):
        _check_rebalance(rank, world, partition)


@pytest.mark.parametrize("world", [2, 4])
def test_balancer_delivers_the_partition(world):
    run_ranks(world, _check_all_partitions)


def _ddp_grads(rank, world, shares, out_path):
    """DDP gradient of a tiny model on unequal per-rank batches with the VBS loss scale."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(sum(shares), 3, generator=g), torch.rand(sum(shares), generator=g)
    lo = sum(shares[:rank])
    mine = slice(lo, lo + shares[rank])
    scale = world * shares[rank] / sum(shares)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(ddp(x[mine]).squeeze(-1), y[mine]) * scale
    loss.backward()
    if rank == 0:
        torch.save([p.grad for p in model.parameters()], out_path)


def test_vbs_loss_scale_matches_single_process_mean(tmp_path):
    shares = [5, 17]  # what vbs gives: unequal counts
    out = tmp_path / "grads.pt"
    run_ranks(2, _ddp_grads, shares, str(out))
    distributed = torch.load(out)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(sum(shares), 3, generator=g), torch.rand(sum(shares), generator=g)
    torch.nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(-1), y).backward()
    for got, want in zip(distributed, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
