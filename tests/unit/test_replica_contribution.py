"""A replica group that catches up in a step takes part in its collectives with zeros, whatever
it holds: three groups' replica layers in one process, a thread each, meeting in every
cross-group collective (``helpers.fake_manager.ThreadedGroups``), two taking part and one
catching up with a batch, gradients, row values and weights of its own in hand. The peers must
end with what the two participants alone make of the step, and the group catching up with the
same, from the peer's state it takes at the vote."""

import torch

from freescale.ft.row_exchange import RowSpace
from helpers.fake_manager import LR, FakeTables, Quorum, ThreadedGroups, in_threads, make_layer

SPACE = RowSpace(rows=(6, 4), widths=(2, 3))  # two blocks of rows, 2 and 3 values wide


def row_values(keys: torch.Tensor) -> dict[int, torch.Tensor]:
    """A group's values of its rows (``keys`` of ``SPACE``), drawn at random."""
    return {int(k): torch.randn(SPACE.widths[0] if k < SPACE.rows[0] else SPACE.widths[1]) for k in keys}


def test_a_group_catching_up_contributes_nothing_and_the_peers_step_as_the_participants_alone():
    hub = ThreadedGroups(3)
    groups = [make_layer([Quorum(participants=2)] if g < 2 else [], replicas=3, replica=g, step=9, next_batch=4,
                         pg=hub.member(g), side=FakeTables(SPACE)) for g in range(3)]
    start = [p.detach().clone() for p in groups[0].model.parameters()]
    # Group 2 is behind: its quorum hands it group 0's state as the step found it (torchft takes
    # it from the peer's registered state, before the peer writes anything in the step).
    groups[2].manager.quorums.append(Quorum(participating=False, participants=2, peer_step=9,
                                            peer_state=groups[0].manager.registered_state()))
    with torch.no_grad():  # weights of its own, which the peer's state replaces
        for p in groups[2].model.parameters():
            p.add_(3.0)
    torch.manual_seed(0)
    keys = [torch.tensor([0, 2, 7]), torch.tensor([2, 5, 9]), torch.tensor([1, 3, 7, 8])]  # group 2's: 1, 3, 8 only
    values = [row_values(k) for k in keys]
    grads = [[torch.randn_like(p) for p in start] for _ in range(3)]
    contributed = {}
    for g, t in enumerate(groups):
        for p, grad in zip(t.model.parameters(), grads[g]):
            p.grad = grad.clone()
        t.layer.on_contribute = lambda step, batch, g=g: contributed.setdefault(g, batch)

    def step(g: int):
        t = groups[g]
        t.layer.begin()
        # Group 2 has run its batch (TorchRec's pipelines do) before learning it catches up.
        plan = t.layer.exchange_rows(keys[g], batch=f"batch of group {g}")
        mine = torch.zeros(plan.size)
        for block in range(len(SPACE.rows)):
            at = plan.values(mine, block)  # a view of the block's rows in ``mine``
            for i, row in enumerate(plan.rows(block).tolist()):
                if row + SPACE.starts[block] in values[g]:
                    at[i] = values[g][row + SPACE.starts[block]]
            if g == 2:  # something at every row of the union besides
                at += 1.0
        return t.layer.finish(plan, mine)

    with torch.random.fork_rng(devices=[]):  # (group 2 loads the peer's random state with the rest)
        votes = in_threads([lambda g=g: step(g) for g in range(3)])
    assert [(v.stepped, v.trained, v.rewritten) for v in votes] == [(True, True, False), (True, True, False),
                                                                    (True, False, True)]
    assert sorted(contributed) == [0, 1]  # the ledger hears of the participants' batches only
    # The reference, from the participants' inputs alone: the rows of groups 0 and 1, each row's
    # values summed over the groups that touched it, and one SGD step of their mean gradient.
    union = sorted(set(keys[0].tolist()) | set(keys[1].tolist()))
    summed = torch.cat([sum(v[k] for v in values[:2] if k in v) for k in union])
    for g, t in enumerate(groups):
        ((applied_keys, applied),) = t.tables.applied
        assert applied_keys.tolist() == union, g
        torch.testing.assert_close(applied, summed, rtol=0, atol=1e-6)
        for p, p0, a, b in zip(t.model.parameters(), start, grads[0], grads[1]):
            torch.testing.assert_close(p.detach(), p0 - LR * (a + b) / 2, rtol=0, atol=1e-6)
    assert groups[2].tables.loaded == [{"side": "tables"}]  # the peer's table side's state
    # What group 2 put into every cross-group collective after the header: zeros.
    header, *rest = hub.sent[2]
    assert rest and all(not t.any() for t in rest)
