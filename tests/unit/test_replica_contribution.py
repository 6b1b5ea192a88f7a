"""A replica group that catches up in a step takes part in its collectives with zeros, whatever
it holds: three groups' replica layers in one process (``helpers.replica_stub``), two taking
part and one catching up with a batch, gradients and row values of its own in hand; the peers
must end with what the two participants alone make of the step."""

import pytest
import torch
import torch.distributed as dist

from freescale.ft.row_exchange import RowSpace
from helpers.replica_stub import FakeManager, SideStub, SumAcrossThreads, in_threads, stub_layer

LR = 0.5
SPACE = RowSpace(rows=(6, 4), widths=(2, 3))  # two blocks of rows, 2 and 3 values wide


@pytest.fixture
def one_rank():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield


def row_values(keys: torch.Tensor) -> dict[int, torch.Tensor]:
    """A group's values of its rows (``keys`` of ``SPACE``), drawn at random."""
    return {int(k): torch.randn(SPACE.widths[0] if k < SPACE.rows[0] else SPACE.widths[1]) for k in keys}


def test_a_group_catching_up_contributes_nothing_and_the_peers_step_as_the_participants_alone(one_rank):
    torch.manual_seed(0)
    start = torch.nn.Linear(3, 2)
    keys = [torch.tensor([0, 2, 7]), torch.tensor([2, 5, 9]), torch.tensor([1, 3, 7, 8])]  # group 2's: 1, 3, 8 only
    values = [row_values(k) for k in keys]
    grads = [[torch.randn_like(p) for p in start.parameters()] for _ in range(3)]
    hub, contributed = SumAcrossThreads(3), {}
    groups = []
    for g in range(3):
        model = torch.nn.Linear(3, 2)
        model.load_state_dict(start.state_dict())
        for p, grad in zip(model.parameters(), grads[g]):
            p.grad = grad.clone()
        params = list(model.parameters())
        layer = stub_layer(replica=g, replicas=3, manager=FakeManager(participating=g < 2, participants=2),
                           pg=hub.member(g), side=SideStub(SPACE), params=params,
                           optimizer=torch.optim.SGD(params, lr=LR), group=dist.new_group([0]), trainer_step=9,
                           next_batch=4)
        layer.on_contribute = lambda step, batch, g=g: contributed.setdefault(g, batch)
        groups.append((layer, model))

    def step(g: int):
        layer, _ = groups[g]
        # Group 2 has run its batch (TorchRec's pipelines do) before learning it catches up.
        plan = layer.exchange_rows(keys[g], batch=f"batch of group {g}")
        mine = torch.zeros(plan.size)
        for block in range(len(SPACE.rows)):
            at = plan.values(mine, block)  # a view of the block's rows in ``mine``
            for i, row in enumerate(plan.rows(block).tolist()):
                if row + SPACE.starts[block] in values[g]:
                    at[i] = values[g][row + SPACE.starts[block]]
            if g == 2:  # something at every row of the union besides
                at += 1.0
        return layer.finish(plan, mine)

    votes = in_threads([lambda g=g: step(g) for g in range(3)])
    assert [(v.stepped, v.trained) for v in votes] == [(True, True), (True, True), (True, False)]
    assert sorted(contributed) == [0, 1]  # the ledger hears of the participants' batches only
    # The reference, from the participants' inputs alone: the rows of groups 0 and 1, each row's
    # values summed over the groups that touched it, and one SGD step of their mean gradient.
    union = sorted(set(keys[0].tolist()) | set(keys[1].tolist()))
    summed = torch.cat([sum(v[k] for v in values[:2] if k in v) for k in union])
    for g in (0, 1):
        layer, model = groups[g]
        ((applied_keys, applied),) = layer.side.applied
        assert applied_keys.tolist() == union, g
        torch.testing.assert_close(applied, summed, rtol=0, atol=1e-6)
        for p, p0, a, b in zip(model.parameters(), start.parameters(), grads[0], grads[1]):
            torch.testing.assert_close(p.detach(), p0.detach() - LR * (a + b) / 2, rtol=0, atol=1e-6)
    # What group 2 put into every cross-group collective after the header: zeros.
    header, *rest = hub.sent[2]
    assert rest and all(not t.any() for t in rest)
