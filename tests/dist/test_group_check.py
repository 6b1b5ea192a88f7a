"""The ranks of a replica group check, before every vote and at the end of a run, that they hold
the same trainer step, torchft step and data cursor (2 gloo ranks, torchft's manager faked)."""

from types import SimpleNamespace

import pytest
import torch.distributed as dist

from helpers.spawn import run_ranks


def _layer(trainer_step: int, manager_step: int, next_batch: int):
    from freescale.ft.replica import ReplicaLayer

    layer = ReplicaLayer.__new__(ReplicaLayer)  # the check alone: no manager server, no lighthouse
    errors = []
    layer.manager = SimpleNamespace(current_step=lambda: manager_step, report_error=errors.append,
                                    errored=lambda: errors[-1] if errors else None)
    layer.state = SimpleNamespace(parts={"trainer": SimpleNamespace(step=trainer_step),
                                         "data": SimpleNamespace(next_batch=next_batch)})
    layer.group, layer.replica = dist.group.WORLD, 1
    return layer, errors


def _check(rank, world):
    layer, errors = _layer(10, 10, 5)
    layer._check_group()
    assert errors == []
    layer.check_group("the end of the run")
    # Rank 1 took a peer's state that rank 0 did not: torchft's step and the trainer's differ.
    layer, errors = _layer(10, 20 if rank else 10, 5)
    layer._check_group()
    assert len(errors) == 1 and "torchft step 10..20" in str(errors[0])
    # A data cursor that differs fails too, and at the end of a run it raises.
    layer, errors = _layer(10, 10, 5 + rank)
    with pytest.raises(RuntimeError, match=r"ranks of replica 1 disagree .*data cursor 5\.\.6\) at the end of the run"):
        layer.check_group("the end of the run")


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
