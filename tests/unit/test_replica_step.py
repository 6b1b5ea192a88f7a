"""The replica layer's step against torchft's parts faked (``helpers.fake_manager``), in one
process: the vote, the commit, the rollback, catching up from a peer's state and joining.
Every expected value is computed here from the scripted inputs (the groups' gradients, the
peer's state), not by the layer's code."""

import json
import math
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from freescale.ft.catchup import transfer_state
from freescale.ft.replica import STATE_KEY, Restore, Vote
from helpers.fake_manager import LR, Peer, Quorum, ThreadedGroups, group_of_ranks, in_threads, make_layer, training_state


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _set_grads(model, value: float) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, value)


def _step(t, keys, batch, grad: float, value: float, begin: bool = True) -> Vote:
    """One step as a pipeline drives it: begin, the rows' exchange, the gradients, finish."""
    if begin:
        t.layer.begin()
    plan = t.layer.exchange_rows(torch.tensor(keys, dtype=torch.int64), batch)
    _set_grads(t.model, grad)
    return t.layer.finish(plan, torch.full((plan.size,), value))


def _peer_state(replicas: int, replica: int, *, step: int, positions: list[int], fill: float) -> dict:
    """What a peer's ``_snapshot`` hands over: its training state (every parameter ``fill``) and tables."""
    state, _, _ = training_state(replicas, replica, step=step, fill=fill)
    state.parts["data"].positions = list(positions)
    return {STATE_KEY: transfer_state({"training": state.state_dict(), "tables": {"peer": "tables"}})}


BATCH = SimpleNamespace(batch_index=0)


def _on_two_ranks(rank) -> dict:
    """``rank(r)`` for the two ranks of a group, a thread each (they meet in the group's
    collectives); their results by rank, an exception of either raised here."""
    results, errors = {}, []

    def run(r):
        try:
            results[r] = rank(r)
        except BaseException as e:  # (reported by the main thread)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert not errors, errors
    assert len(results) == 2, "a rank did not finish"
    return results


# The commit --------------------------------------------------------------------------------

def test_a_committed_step_averages_the_gradients_applies_the_rows_and_records_the_peers_cursors(tmp_path):
    peer = Peer(1, cursor_after=5, keys=torch.tensor([3, 6]), dense=1.0, rows=0.5)
    t = make_layer(run_dir=tmp_path, quorums=[Quorum(participants=2, peers=[peer])])
    contributed = []
    t.layer.on_contribute = lambda step, batch: contributed.append((step, batch))
    before = _params(t.model)

    vote = _step(t, [1, 3], BATCH, grad=2.0, value=0.25)

    assert vote == Vote(stepped=True, trained=True, rewritten=False)
    assert contributed == [(1, BATCH)]  # before the step's first cross-replica collective
    # SGD over the mean of the two groups' gradients: (2 + 1) / 2.
    for p, b in zip(t.model.parameters(), before):
        torch.testing.assert_close(p.detach(), b - LR * 1.5, rtol=0, atol=1e-7)
        assert p.grad is None
    # The rows: the union of both groups' keys, each row's values summed over the groups.
    (keys, summed), = t.tables.applied
    assert keys.tolist() == [1, 3, 6]
    assert summed.tolist() == [0.75] * (3 * 2)
    assert t.tables.events == ["committed", "apply"]
    # This group's header: in the step, with a batch, its cursor after it and two keys.
    assert t.pg.calls[0].view(5, 2)[:, 0].tolist() == [1, 1, 1, 2, 0]
    assert t.state.parts["data"].positions == [0, 5]  # the peer's cursor as the step leaves it
    assert t.manager.current_step() == 1

    t.state.parts["trainer"].step = 1
    t.layer.committed(1, 1, True)
    with open(tmp_path / "ft_cursor.json") as f:
        assert {k: v for k, v in json.load(f).items() if k != "time"} == {"step": 1, "next_batch": 1}
    with open(tmp_path / "ft_commits.jsonl") as f:
        assert [{k: v for k, v in json.loads(line).items() if k not in ("time", "blocked_s")} for line in f] == [
            {"step": 1, "next_batch": 1, "trained": True}]
    with pytest.raises(RuntimeError, match="step 2 but torchft's manager is at 1"):
        t.layer.committed(2, 2, True)


def test_a_group_alone_divides_by_one_and_sends_nothing_for_an_empty_union(tmp_path):
    t = make_layer(run_dir=tmp_path, quorums=[Quorum(participants=1)])
    before = _params(t.model)
    assert _step(t, [], BATCH, grad=2.0, value=0.0) == Vote(True, True)
    for p, b in zip(t.model.parameters(), before):
        torch.testing.assert_close(p.detach(), b - LR * 2.0, rtol=0, atol=1e-7)
    assert [c.dtype for c in t.pg.calls] == [torch.int64, torch.float32]  # header and dense only


# A step not committed ----------------------------------------------------------------------

def test_a_lost_vote_rolls_back_trains_nothing_and_leaves_the_cursors(tmp_path):
    peer = Peer(1, cursor_after=5, keys=torch.tensor([2]), dense=1.0, rows=0.5)
    t = make_layer(run_dir=tmp_path, quorums=[Quorum(participants=2, peers=[peer], others_vote=False)])
    before = _params(t.model)

    assert _step(t, [1], BATCH, grad=2.0, value=0.25) == Vote(stepped=False, trained=False)

    assert t.tables.events == ["rollback"] and t.tables.applied == []
    for p, b in zip(t.model.parameters(), before):
        assert torch.equal(p.detach(), b) and p.grad is None
    assert t.state.parts["data"].positions == [0, 0]
    assert t.manager.current_step() == 0


def test_a_failed_catch_up_puts_torchfts_step_back_to_the_trainers(tmp_path):
    # The quorum moved torchft's step to the peer's; the fetch failed: the step is not committed
    # and the manager counts from the trainer's step again.
    t = make_layer(run_dir=tmp_path, quorums=[Quorum(participating=False, participants=1, peer_step=9, peer_state=None,
                                                     peers=[Peer(1, cursor_after=12, dense=1.0)])], step=3)
    before = _params(t.model)
    t.layer.begin()
    assert t.layer.wait_quorum() == 10 and t.manager.current_step() == 9

    assert _step(t, [1], BATCH, grad=2.0, value=0.0, begin=False) == Vote(stepped=False, trained=False)

    assert t.manager.current_step() == 3
    assert t.tables.events == ["rollback"]
    assert all(torch.equal(p.detach(), b) for p, b in zip(t.model.parameters(), before))


@pytest.mark.parametrize("fail_call", [0, 1, 2, 3])
def test_a_failed_collective_aborts_the_group_skips_the_rest_and_fails_the_step(tmp_path, fail_call):
    # The step's collectives: header, keys, dense gradients, rows' values.
    peer = Peer(1, cursor_after=5, keys=torch.tensor([3]), dense=1.0, rows=0.5)
    t = make_layer(run_dir=tmp_path, quorums=[Quorum(participants=2, peers=[peer], fail_call=fail_call)])
    before = _params(t.model)

    assert _step(t, [1], BATCH, grad=2.0, value=0.25) == Vote(stepped=False, trained=False)

    assert t.pg.aborted == 1
    assert len(t.pg.calls) == fail_call + 1  # nothing issued after the failure
    assert "a peer died" in str(t.manager.errored())
    assert t.tables.events == ["rollback"] and t.tables.applied == []
    assert all(torch.equal(p.detach(), b) for p, b in zip(t.model.parameters(), before))
    # The next step starts afresh.
    assert _step(t, [1], BATCH, grad=2.0, value=0.25) == Vote(stepped=True, trained=True)


# Catching up --------------------------------------------------------------------------------

@pytest.mark.parametrize("peers_position,trained", [(4, False), (5, True)])
def test_a_group_catching_up_takes_the_peers_state_at_the_vote_and_learns_its_batch_from_the_cursor(
        tmp_path, peers_position, trained):
    # The group's cursor is at 4; the peer's state holds it at 4 (the batch in hand is trained
    # again) or 5 (the peers committed a step with it that this group's vote lost).
    state = _peer_state(2, 0, step=9, positions=[peers_position, 20], fill=7.0)
    peer = Peer(1, cursor_after=21, keys=torch.tensor([2]), dense=1.0, rows=0.5)
    t = make_layer(run_dir=tmp_path, quorums=[Quorum(participating=False, participants=1, peer_step=9, peer_state=state,
                                                     peers=[peer])], step=3, next_batch=4)
    contributed = []
    t.layer.on_contribute = lambda step, batch: contributed.append(step)
    before = _params(t.model)

    t.layer.begin()
    plan = t.layer.exchange_rows(torch.tensor([1, 5]), BATCH)
    _set_grads(t.model, 2.0)
    # Before the vote nothing of the peer's is in: the state is the group's own.
    assert all(torch.equal(p.detach(), b) for p, b in zip(t.model.parameters(), before))
    assert t.state.parts["trainer"].step == 3 and "load" not in t.tables.events
    vote = t.layer.finish(plan, torch.full((plan.size,), 0.25))

    assert vote == Vote(stepped=True, trained=trained, rewritten=True)
    assert contributed == []  # no batch of its own in the step
    # It contributed zeros: no keys, no batch, and the peer's gradient alone over one participant.
    assert t.pg.calls[0].view(5, 2)[:, 0].tolist() == [1, 0, 0, 0, 0]
    (keys, summed), = t.tables.applied
    assert keys.tolist() == [2] and summed.tolist() == [0.5, 0.5]
    for p in t.model.parameters():
        torch.testing.assert_close(p.detach(), torch.full_like(p, 7.0 - LR * 1.0), rtol=0, atol=1e-6)
    assert t.state.parts["trainer"].step == 9  # the peer's (the trainer counts the step)
    assert t.state.parts["data"].positions == [peers_position, 21]
    assert t.tables.loaded == [{"peer": "tables"}]
    assert t.tables.events == ["load", "committed", "apply"]
    assert t.manager.current_step() == 10


def test_a_lost_vote_drops_the_peers_state_it_received(tmp_path):
    # Group-atomic: the state arrived on this rank, another rank of the group voted no.
    state = _peer_state(2, 0, step=9, positions=[4, 20], fill=7.0)
    t = make_layer(run_dir=tmp_path, quorums=[Quorum(participating=False, participants=1, peer_step=9, peer_state=state,
                                                     others_vote=False), Quorum(participants=1)], step=3, next_batch=4)
    before = _params(t.model)
    assert _step(t, [], BATCH, grad=0.0, value=0.0) == Vote(stepped=False, trained=False)
    assert all(torch.equal(p.detach(), b) for p, b in zip(t.model.parameters(), before))
    assert t.tables.loaded == [] and t.state.parts["trainer"].step == 3
    # The next step, committed, does not take the dropped state either.
    assert _step(t, [], BATCH, grad=0.0, value=0.0) == Vote(stepped=True, trained=True)
    assert t.tables.loaded == [] and t.state.parts["trainer"].step == 3


def test_a_peers_state_with_this_groups_cursor_further_ahead_stops_the_group(tmp_path):
    state = _peer_state(2, 0, step=9, positions=[6, 20], fill=7.0)
    t = make_layer(run_dir=tmp_path, quorums=[Quorum(participating=False, participants=1, peer_step=9, peer_state=state)],
                   step=3, next_batch=4)
    with pytest.raises(RuntimeError, match="holds its data cursor at batch 6, but it is at batch 4: restart the group"):
        _step(t, [], BATCH, grad=0.0, value=0.0)


# The vote's checks --------------------------------------------------------------------------

def test_too_few_groups_in_the_step_fail_it_and_a_group_catching_up_counts(tmp_path):
    t = make_layer(run_dir=tmp_path, quorums=[Quorum(participants=1),
                                              Quorum(participants=1, peers=[Peer(2, cursor_after=None)])],
                   replicas=3, min_replicas=2)
    assert _step(t, [], BATCH, grad=1.0, value=0.0) == Vote(stepped=False, trained=False)
    assert "1 replica group(s) in the step, ft.min_replicas is 2" in str(t.manager.errored())
    assert _step(t, [], BATCH, grad=1.0, value=0.0) == Vote(stepped=True, trained=True)


@pytest.mark.parametrize("participants", [4, 1, 2])
def test_sqrt_scaling_steps_with_the_learning_rate_times_the_root_of_the_participants_share(tmp_path, participants):
    t = make_layer(run_dir=tmp_path, quorums=[Quorum(participants=participants)], replicas=4, lr_scaling="sqrt")
    before = _params(t.model)
    assert _step(t, [], BATCH, grad=float(participants), value=0.0).stepped
    # The group's gradient, divided by the participants (the peers sent zeros): 1.
    lr = LR * math.sqrt(participants / 4)
    for p, b in zip(t.model.parameters(), before):
        torch.testing.assert_close(p.detach(), b - lr * 1.0, rtol=0, atol=1e-7)


def test_ranks_of_a_group_that_disagree_fail_the_step_and_the_end_of_the_run(tmp_path):
    store = dist.HashStore()

    def rank(r):
        t = make_layer(run_dir=tmp_path / f"rank{r}", quorums=[Quorum(participants=1)] * 2,
                       group=group_of_ranks(r, 2, store), rank=r)
        t.manager._step = 5 if r else 0  # rank 1 holds another torchft step
        result = [_step(t, [], BATCH, grad=1.0, value=0.0), str(t.manager.errored())]
        t.state.parts["data"].positions[0] = 4 + r  # (the failed vote put torchft's step back)
        with pytest.raises(RuntimeError) as raised:
            t.layer.check_group("the end of the run")
        return [*result, str(raised.value)]

    results = _on_two_ranks(rank)
    for r in range(2):
        vote, error, raised = results[r]
        assert vote == Vote(stepped=False, trained=False)
        assert "ranks of replica 0 disagree (trainer step 0..0, torchft step 0..5, data cursor 0..0)" in error
        assert raised.endswith("data cursor 4..5) at the end of the run"), raised


# Joining ------------------------------------------------------------------------------------

def test_joining_behind_a_live_group_catches_up_in_a_zero_step(tmp_path):
    # The peer's state holds this group's cursor further on (the job's newest state, a batch of
    # this group's that its restart lost): joining, the group takes it as it is.
    state = _peer_state(2, 0, step=9, positions=[6, 20], fill=7.0)
    peer = Peer(1, cursor_after=21, keys=torch.tensor([2]), dense=1.0, rows=0.5)
    t = make_layer(run_dir=tmp_path, quorums=[Quorum(participating=False, participants=1, peer_step=9, peer_state=state,
                                                     peers=[peer])], step=3, next_batch=4)
    t.layer.join(restore=None)

    assert t.state.parts["trainer"].step == 10 and t.manager.current_step() == 10
    assert t.pg.calls[0].view(5, 2)[:, 0].tolist() == [1, 0, 0, 0, 0]  # in the step, no batch
    for p in t.model.parameters():  # the peer's weights, stepped with the peer's gradient alone
        torch.testing.assert_close(p.detach(), torch.full_like(p, 7.0 - LR * 1.0), rtol=0, atol=1e-6)
    assert t.state.parts["data"].positions == [6, 21]
    with open(tmp_path / "ft_commits.jsonl") as f:
        assert [{k: v for k, v in json.loads(line).items() if k not in ("time", "blocked_s")} for line in f] == [
            {"step": 10, "next_batch": 6, "trained": False}]
    # The next step takes a quorum of its own.
    t.layer.begin()
    assert t.manager.calls.count("start_quorum") == 2


def test_joining_with_no_group_ahead_lets_the_step_pass_restores_and_keeps_the_next_quorum(tmp_path):
    t = make_layer(run_dir=tmp_path, quorums=[Quorum(participants=1), Quorum(participants=1)], step=3, next_batch=4)
    restored = []

    def restore():
        restored.append((t.manager.votes[:], t.pg.calls[0].view(5, 2)[:, 0].tolist()))
        t.state.parts["trainer"].step = 7
        t.state.parts["data"].positions = [6, 8]

    t.layer.join(Restore(step=7, load=restore))

    # After the group voted against the step it was in with no batch, vetoing it.
    assert restored == [([False], [1, 0, 0, 0, 1])]
    assert t.tables.events == ["rollback", "load"] and t.tables.loaded == [{}]
    assert t.manager.current_step() == 7
    with open(tmp_path / "ft_cursor.json") as f:
        assert {k: v for k, v in json.load(f).items() if k != "time"} == {"step": 7, "next_batch": 6}
    assert t.manager.calls.count("start_quorum") == 2
    # The first step runs in the quorum the join left open.
    assert _step(t, [], BATCH, grad=1.0, value=0.0) == Vote(stepped=True, trained=True)
    assert t.manager.calls.count("start_quorum") == 2


@pytest.mark.parametrize("newest", [9, 12])
def test_joining_behind_a_live_group_catches_up_unless_the_jobs_newest_checkpoint_is_further(tmp_path, newest):
    # A live group at step 9 and the job's newest checkpoint at step 9: the group catches up from
    # the live one. At step 12 (the live group started late, or its catch-up failed when the
    # group it fetched from died): the group vetoes the step, loads the checkpoint and opens the
    # next quorum, where it is the furthest (the live group catches up from it).
    state = _peer_state(2, 0, step=9, positions=[6, 20], fill=7.0)
    peer = Peer(1, cursor_after=21, dense=1.0)
    t = make_layer(run_dir=tmp_path, quorums=[Quorum(participating=False, participants=1, peer_step=9, peer_state=state,
                                                     peers=[peer]), Quorum(participants=2)])
    loaded = []

    def load():
        loaded.append((t.manager.votes[:], t.pg.calls[0].view(5, 2)[:, 0].tolist()))
        t.state.parts["trainer"].step = newest

    t.layer.join(Restore(step=newest, load=load))

    if newest == 9:
        assert loaded == [] and t.state.parts["trainer"].step == 10 and t.manager.votes == [True]
        assert t.pg.calls[0].view(5, 2)[:, 0].tolist() == [1, 0, 0, 0, 0]
        assert t.manager.calls.count("start_quorum") == 1
    else:
        assert loaded == [([False], [1, 0, 0, 0, 1])]  # after its vote against the step it vetoed
        assert t.state.parts["trainer"].step == 12 and t.manager.current_step() == 12
        assert t.tables.loaded == [{}]  # the peer's tables were not taken
        assert t.manager.calls.count("start_quorum") == 2  # the first step's quorum is open
        t.layer.begin()
        assert t.manager.calls.count("start_quorum") == 2


def test_joining_ranks_decide_alike_when_one_ranks_fetch_failed(tmp_path):
    # Rank 0's fetch failed before torchft moved its step to the peer's (9); rank 1's did not.
    # Compared alone with the job's newest checkpoint (step 7), rank 0 would load it while rank 1
    # catches up: the group's ranks decide on the quorum's furthest step as the group sees it.
    store = dist.HashStore()
    state = _peer_state(2, 0, step=9, positions=[0, 20], fill=7.0)

    def rank(r):
        first = Quorum(participating=False, peer_step=9, peer_state=state, peers=[Peer(1, cursor_after=21)],
                       step_moved=bool(r), error=None if r else RuntimeError("fetching the peer's state failed"))
        again = Quorum(participating=False, peer_step=9, peer_state=state, peers=[Peer(1, cursor_after=21)])
        t = make_layer(run_dir=tmp_path, quorums=[first, again], group=group_of_ranks(r, 2, store), rank=r)
        loaded = []
        t.layer.join(Restore(step=7, load=lambda: loaded.append(r)))
        return loaded, t.state.parts["trainer"].step, t.manager.votes

    assert _on_two_ranks(rank) == {r: ([], 10, [False, True]) for r in range(2)}


def test_a_group_vetoing_the_step_fails_it_in_every_group_in_the_step(tmp_path):
    # Two layers meeting through the threaded process group: group 0 is live at step 0 with a
    # batch (it started late and has trained nothing); group 1 restarts and, finding no live group
    # ahead, joins by loading the job's newest checkpoint (step 7). Group 0 must not commit the
    # step: its state would be one the restored group overtakes, and its batch lost when it then
    # catches up.
    hub = ThreadedGroups(2)
    live = make_layer(run_dir=tmp_path / "g0", replica=0, pg=hub.member(0), quorums=[Quorum(participants=2)])
    joining = make_layer(run_dir=tmp_path / "g1", replica=1, pg=hub.member(1),
                         quorums=[Quorum(participants=2), Quorum(participants=2)])
    (tmp_path / "g0").mkdir()
    (tmp_path / "g1").mkdir()
    before = _params(live.model)

    def load():
        joining.state.parts["trainer"].step = 7

    vote, _ = in_threads([lambda: _step(live, [1], BATCH, grad=2.0, value=0.5),
                          lambda: joining.layer.join(Restore(step=7, load=load))])

    assert vote == Vote(stepped=False, trained=False)
    assert "replica group replica1 vetoed the step" in str(live.manager.errored())
    assert all(torch.equal(p.detach(), b) for p, b in zip(live.model.parameters(), before))
    assert live.tables.events == ["rollback"] and live.state.parts["data"].next_batch == 0
    assert joining.state.parts["trainer"].step == 7


def test_joining_in_step_with_the_others_and_nothing_to_restore_opens_the_first_steps_quorum(tmp_path):
    t = make_layer(run_dir=tmp_path, quorums=[Quorum(participants=2)], step=3, next_batch=4)
    t.layer.join(None)
    assert t.manager.votes == [] and t.tables.events == [] and t.state.parts["trainer"].step == 3
    t.layer.begin()
    assert t.manager.calls.count("start_quorum") == 1


def test_the_layer_registers_its_state_with_the_manager_and_hands_a_copy(tmp_path):
    t = make_layer(run_dir=tmp_path, step=4)
    snapshot = t.manager.registered_state()[STATE_KEY]
    assert int(snapshot["training"]["trainer"]["step"]) == 4 and snapshot["tables"] == {"side": "tables"}
    weight = t.model.weight
    with torch.no_grad():
        weight.add_(1.0)
    assert not torch.equal(snapshot["training"]["model"]["weight"], weight)  # a copy
    t.layer.close()
    assert t.manager.shut_down
