"""The ranks of a replica group check, before every vote and at the end of a run, that they hold
the same trainer step, torchft step and data cursor, and a step whose vote finds them apart is
not committed (2 gloo ranks, torchft's manager and process group faked:
``helpers.fake_manager``)."""

import pytest
import torch.distributed as dist

from helpers.spawn import run_ranks


def _layer(trainer_step: int, manager_step: int, next_batch: int):
    from helpers.fake_manager import make_layer

    t = make_layer(replicas=2, replica=1, step=trainer_step, next_batch=next_batch, group=dist.group.WORLD,
                   rank=dist.get_rank())
    t.manager._step = manager_step  # (the layer put it back to the trainer's)
    return t.layer, t.manager


def _check(rank, world):
    layer, manager = _layer(10, 10, 5)
    layer._check_group()
    assert manager.errored() is None
    layer.check_group("the end of the run")
    # Rank 1 took a peer's state that rank 0 did not: torchft's step and the trainer's differ.
    layer, manager = _layer(10, 20 if rank else 10, 5)
    layer._check_group()
    assert "torchft step 10..20" in str(manager.errored())
    # A data cursor that differs fails too, and at the end of a run it raises.
    layer, manager = _layer(10, 10, 5 + rank)
    with pytest.raises(RuntimeError, match=r"ranks of replica 1 disagree .*data cursor 5\.\.6\) at the end of the run"):
        layer.check_group("the end of the run")
    # A step whose vote finds the ranks apart is not committed, on either rank: nothing is
    # applied, what the step wrote goes back, torchft's step stays the trainer's.
    vote, moved, rolled_back, applied, step = _vote(rank, world, next_batch=5)
    assert (vote.stepped, vote.trained, moved, rolled_back, applied, step) == (True, True, True, 0, 1, 11)
    vote, moved, rolled_back, applied, step = _vote(rank, world, next_batch=5 + rank)
    assert (vote.stepped, vote.trained, moved, rolled_back, applied, step) == (False, False, False, 1, 0, 10)


def _vote(rank, world, next_batch: int) -> tuple:
    """A whole step of a group of one replica (torchft's manager faked: it commits unless an
    error was reported) on this rank holding data cursor ``next_batch``: (its vote, whether the
    dense weights moved, the table side's rollbacks and applied steps, torchft's step after it)."""
    import torch

    from freescale.ft.replica import NO_KEYS
    from helpers.fake_manager import Quorum, make_layer

    t = make_layer([Quorum(participants=1)], replicas=1, step=10, next_batch=next_batch, group=dist.group.WORLD,
                   rank=rank)
    before = [p.detach().clone() for p in t.model.parameters()]
    t.layer.begin()
    plan = t.layer.exchange_rows(NO_KEYS, batch="its batch")
    for p in t.model.parameters():
        p.grad = torch.ones_like(p)
    vote = t.layer.finish(plan, torch.zeros(plan.size))
    moved = any(not torch.equal(p.detach(), b) for p, b in zip(t.model.parameters(), before))
    return vote, moved, t.tables.events.count("rollback"), len(t.tables.applied), t.manager.current_step()


def test_a_group_whose_ranks_disagree_fails_its_step():
    run_ranks(2, _check)


def _decide_from_files(rank, world, root):
    from pathlib import Path

    from freescale.train.trainer import group_has_run_before, job_checkpoints_agreed

    # Each rank looks at the job's files a moment apart: rank 1 after another group wrote its
    # first checkpoint, rank 0 before (a folder of each rank's own plays the two looks).
    folder = Path(root) / f"look{rank}"
    if rank == 1:
        step = folder / "checkpoints" / "step_00000007"
        step.mkdir(parents=True)
        (step / ".metadata").write_text("")
    folder.mkdir(exist_ok=True)
    assert group_has_run_before(str(folder), dist.group.WORLD) is False  # rank 0's look, on both
    assert job_checkpoints_agreed(str(folder), dist.group.WORLD) == []


def test_the_ranks_of_a_group_decide_from_the_jobs_files_alike(tmp_path):
    # A group that decided apart whether it has run before would send one rank into the join's
    # zero step and the other into training, each waiting for the other's collective.
    run_ranks(2, _decide_from_files, str(tmp_path))
