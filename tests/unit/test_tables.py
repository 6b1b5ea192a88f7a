"""ShardedTables on one process: the row-wise layout, initialization that no world size changes,
lookups and the fused update (a tracked lookup's backward, a zero row untouched)."""

import pytest
import torch
import torch.distributed as dist

from freescale.embedding.exchange import ShardedTables


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield


def tables(rank=0, world=1, optimizer="rowwise_adagrad", rows=(200_000, 7)):
    return ShardedTables({"items": rows[0], "users": rows[1]}, 4, rank=rank, world_size=world,
                         group=dist.group.WORLD, optimizer=optimizer, lr=0.1, init_std=0.1, seed=3)


def test_rows_are_cut_in_torchrec_row_wise_blocks():
    t = tables(rank=2, world=3)
    assert t.blocks == [66_667, 3]
    assert t.local_rows[2] == [200_000 - 2 * 66_667, 1]  # the last block is shorter
    owners, local = t.locate(0, torch.tensor([0, 66_666, 66_667, 199_999]))
    assert owners.tolist() == [0, 0, 1, 2] and local.tolist() == [0, 66_666, 0, 199_999 - 2 * 66_667]
    owners, local = t.locate(1, torch.tensor([0, 6]))
    # A user row lands after its owner's item rows in the owner's local table.
    assert owners.tolist() == [0, 2] and local.tolist() == [66_667, t.local_rows[2][0]]


@pytest.mark.parametrize("world", [2, 3, 5])
def test_initial_rows_do_not_depend_on_the_world_size(world):
    full = tables().weight
    parts = [tables(rank=r, world=world) for r in range(world)]
    items = torch.cat([p.weight[:p.local_rows[r][0]] for r, p in enumerate(parts)])
    users = torch.cat([p.weight[p.local_rows[r][0]:sum(p.local_rows[r])] for r, p in enumerate(parts)])
    assert torch.equal(items, full[:200_000]) and torch.equal(users, full[200_000:])
    assert abs(float(full.std()) - 0.1) < 0.002


def test_a_tracked_lookups_backward_updates_its_rows_and_a_zero_row_stays_as_it_was():
    a, b = tables(), tables()
    ids = torch.tensor([5, 9, 5, 11])
    grads = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a.lookup(ids), a.weight[ids])
    a.update(ids, grads)
    # The same update through a tracked lookup, plus a row whose gradient is zero.
    looked_up = b.lookup(torch.cat([ids, torch.tensor([42])]), track=True)
    b.update_looked_up(looked_up, torch.cat([grads, torch.zeros(1, 4)]))
    assert torch.equal(a.weight, b.weight) and torch.equal(a.momentum(), b.momentum())
    fresh = tables()
    assert not torch.equal(a.weight[5], fresh.weight[5]) and torch.equal(b.weight[42], fresh.weight[42])
    assert float(b.momentum()[42]) == 0.0 and float(b.momentum()[5]) > 0.0


def test_the_checkpoint_state_is_the_kernels_storage():
    t = tables(world=1)
    state = t.sharded_state()
    assert sorted(state) == ["items.momentum", "items.weight", "users.momentum", "users.weight"]
    assert state["items.weight"].shape == (200_000, 4) and state["users.momentum"].shape == (7,)
    assert state["items.weight"].to_local().data_ptr() == t.weight.data_ptr()
    other = tables()
    other.update(torch.tensor([1]), torch.ones(1, 4))
    t.load_sharded_state(other.sharded_state())
    assert torch.equal(t.weight, other.weight) and torch.equal(t.momentum(), other.momentum())
    with pytest.raises(KeyError, match="unexpected embedding state 'items.bias'"):
        t.load_sharded_state({"items.bias": torch.zeros(1)})
