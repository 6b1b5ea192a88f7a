"""The sync of TorchRec's fused tables across replica groups: every group's changes since the
last sync added up, rollbacks, a group that caught up in between; groups simulated in one
process on real fbgemm kernels (the all-reduce is a sum of their buffers)."""

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (ComputeDevice,
                                                                    SplitTableBatchedEmbeddingBagsCodegen)

from freescale.ft.row_exchange import pack_keys, plan_rows
from freescale.ft.rows import kernel_blocks
from freescale.ft.table_sync import TableSync


class Kernels:
    """What ``TableSync`` reads of ``FusedTables``: the row blocks of one fbgemm kernel with
    two tables (12 x 4 and 5 x 4 rows, row-wise Adagrad), the same initial rows in every group."""

    def __init__(self) -> None:
        self.kernel = SplitTableBatchedEmbeddingBagsCodegen(
            [(12, 4, EmbeddingLocation.HOST, ComputeDevice.CPU), (5, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)],
            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, pooling_mode=PoolingMode.NONE, learning_rate=0.1)
        with torch.no_grad():
            for i, block in enumerate(kernel_blocks(self.kernel)):
                block[0].copy_(torch.arange(block[0].numel(), dtype=torch.float32).view_as(block[0]) / (i + 7))

    def blocks(self):
        return kernel_blocks(self.kernel)


def group(every=10):
    return TableSync(Kernels(), every=every, checkpoint_every=0, last_step=100)


def train(sync: TableSync, block: int, rows: list[int], delta: float) -> None:
    """A step's lookup reports ``rows``, then backward changes them (weights and momentum)."""
    ids = torch.tensor(rows)
    sync.touch([(block, ids)])
    with torch.no_grad():
        weights, momentum = sync.blocks[block]
        weights[ids] += delta
        momentum[ids] += abs(delta)
    sync.committed()


def sync_all(groups: list[TableSync], step: int, present=None) -> None:
    """One sync step across ``groups`` (``present``: the ones that take part; the others
    catch up in it and contribute nothing), then each applies the result."""
    present = present or groups
    keys = [g.keys(step) if g in present else torch.zeros(0, dtype=torch.int64) for g in groups]
    counts = torch.tensor([len(k) for k in keys])
    gathered = torch.stack([pack_keys(k, counts, i) for i, k in enumerate(keys)]).sum(0)
    plan = plan_rows(groups[0].space, gathered)
    total = torch.stack([g.values(plan) if g in present else torch.zeros(plan.size) for g in groups]).sum(0)
    for g in groups:
        g.apply(plan, total.clone())


def tables(sync: TableSync) -> list[torch.Tensor]:
    return [t.clone() for block in sync.blocks for t in block]


def test_a_sync_adds_every_groups_change_to_the_rows_base():
    a, b = group(), group()
    base = tables(a)
    train(a, 0, [1, 2, 2], 1.0)  # only a touches row 1, both touch row 2
    train(b, 0, [2, 3], 0.25)
    train(b, 1, [4], -2.0)
    train(a, 0, [2], 1.0)  # a second step on row 2
    sync_all([a, b], step=10)
    assert all(torch.equal(x, y) for x, y in zip(tables(a), tables(b)))
    weights, momentum = tables(a)[0], tables(a)[1]
    assert torch.equal(weights[1], base[0][1] + 1.0)  # not halved, as averaging the copies would
    assert torch.equal(weights[2], base[0][2] + 2.0 + 0.25)
    assert torch.equal(weights[3], base[0][3] + 0.25)
    assert torch.equal(momentum[2:4], base[1][2:4] + torch.tensor([2.25, 0.25]))
    assert torch.equal(tables(a)[2][4], base[2][4] - 2.0)
    untouched = [0, 4, 5, 6, 7, 8, 9, 10, 11]
    assert torch.equal(weights[untouched], base[0][untouched])


def test_only_sync_steps_exchange_rows_and_a_sync_starts_the_count_again():
    a = group(every=10)
    train(a, 0, [5], 1.0)
    assert a.keys(9).numel() == 0 and a.keys(10).tolist() == [5]
    assert TableSync(Kernels(), every=0, checkpoint_every=4, last_step=7).due(8)  # checkpoints are sync steps
    assert TableSync(Kernels(), every=0, checkpoint_every=0, last_step=7).due(7)
    b = group()
    sync_all([a, b], step=10)
    assert a.keys(20).numel() == 0  # nothing touched since the sync
    train(b, 0, [5], 1.0)
    sync_all([a, b], step=20)
    assert torch.equal(tables(a)[0][5], tables(b)[0][5])


def test_a_rolled_back_step_leaves_the_rows_and_the_changes_as_they_were():
    a, b = group(), group()
    train(a, 0, [1], 1.0)
    before = tables(a)
    a.touch([(0, torch.tensor([1, 7]))])
    with torch.no_grad():
        a.blocks[0][0][torch.tensor([1, 7])] += 5.0
    a.rollback()
    assert all(torch.equal(x, y) for x, y in zip(tables(a), before))
    sync_all([a, b], step=10)
    assert torch.equal(tables(b)[0][7], Kernels().blocks()[0][0][7])  # row 7 changed by no committed step
    assert torch.equal(tables(b)[0][1], Kernels().blocks()[0][0][1] + 1.0)


def test_a_group_that_caught_up_counts_its_changes_from_the_peers_state():
    a, b, c = group(), group(), group()
    train(a, 0, [1, 2], 1.0)
    train(b, 0, [2], 0.5)
    # c catches up from a: a's tables and a's touched rows with their values at the last sync.
    sent = {k: [t.clone() for t in v] for k, v in a.state_dict().items()}
    with torch.no_grad():
        for block_c, block_a in zip(c.blocks, a.blocks):
            for tc, ta in zip(block_c, block_a):
                tc.copy_(ta)
    c.load_state_dict(sent)
    train(c, 0, [2, 3], 0.125)
    train(a, 0, [3], 2.0)
    sync_all([a, b, c], step=10)
    assert all(torch.equal(x, y) for g in (b, c) for x, y in zip(tables(a), tables(g)))
    base = Kernels().blocks()[0][0]
    assert torch.equal(tables(a)[0][2], base[2] + 1.0 + 0.5 + 0.125)  # a's change counted once
    assert torch.equal(tables(a)[0][3], base[3] + 0.125 + 2.0)


def test_a_group_catching_up_in_the_sync_step_takes_the_result_on_the_peers_state():
    a, b, late = group(), group(), group()
    train(a, 0, [4], 1.0)
    train(b, 0, [4, 9], 3.0)
    sent = a.state_dict()
    with torch.no_grad():  # late loads a's state at its vote, before the result applies
        for block_l, block_a in zip(late.blocks, a.blocks):
            for tl, ta in zip(block_l, block_a):
                tl.copy_(ta)
    late.load_state_dict(sent)
    sync_all([a, b, late], step=10, present=[a, b])
    assert all(torch.equal(x, y) for g in (b, late) for x, y in zip(tables(a), tables(g)))
