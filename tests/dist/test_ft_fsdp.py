"""``dense.sharding: fsdp`` under the replica layer, 2 groups of 2 ranks (`freescale local`):
each rank's shard of the dense gradients crosses between the groups, and the run trains as the
replicated one; a killed group catches up (each rank the same-rank peer's shards) exactly once."""

import pytest
import torch

from helpers.launch import check
from helpers.ft_runs import EVERY_7, assert_exactly_once, assert_groups_agree, assert_kept_committing, final_state, local, logs

pytestmark = pytest.mark.slow

STEPS = ["--train.steps=50", "--checkpoint.at_end=true", "--checkpoint.every=0"]


def test_fsdp_groups_train_as_replicated_groups(tmp_path):
    # The sync and prioritized pipelines with fsdp against sync with replicate. Both groups in
    # every step (min_replicas 2), so each run's steps are the same whatever the timing.
    # Tolerance 0: every sum here has two terms (two ranks in a group, two groups), which add
    # alike in any order, and each mean halves them exactly; so the shards' reductions give the
    # replicated run's numbers bit for bit (tests/dist/test_dense_sharding.py says more), and the
    # prioritized pipeline's the synchronous one's.
    runs = {}
    for pipeline, sharding in (("sync", "replicate"), ("sync", "fsdp"), ("prioritized", "fsdp")):
        run = tmp_path / f"{pipeline}-{sharding}"
        proc, summary = local(run, "--replicas", "2", "--nproc", "2", "--ft.min_replicas=2",
                              f"--train.pipeline={pipeline}", f"--dense.sharding={sharding}", *STEPS)
        check(proc)
        assert_exactly_once(run, summary, 50)
        runs[pipeline, sharding] = [final_state(run / f"replica{r}", run) for r in range(2)]
    for variant in (("sync", "fsdp"), ("prioritized", "fsdp")):
        for r in range(2):
            reference, got = runs["sync", "replicate"][r], runs[variant][r]
            keys = {k for k in reference if k.startswith(("model.", "optimizer."))}
            assert any(k.startswith("model.task.") for k in keys)
            assert keys == {k for k in got if k.startswith(("model.", "optimizer."))}
            for key in keys:
                assert torch.equal(got[key], reference[key]), (variant, r, key)


def test_a_killed_fsdp_group_catches_up_shard_by_shard_exactly_once(tmp_path):
    # As test_ft's killed group of two ranks (sync), with the dense part sharded: rank r of the
    # group that comes back takes rank r's shards of a live group's parameters and optimizer
    # state. A shard taken from the wrong rank, or not at all, leaves the groups' dense states
    # apart at the checkpoints after the rejoin.
    run = tmp_path / "run"
    proc, summary = local(run, "--replicas", "2", "--nproc", "2", "--kill", "1@10", "--dense.sharding=fsdp",
                          "--faults=[{at_step: 60, during: vote, kind: hold, replicas: [0]}]", *EVERY_7,
                          "--train.steps=160", "--checkpoint.at_end=true")
    check(proc)
    failures = summary["groups"][1]["failures"]
    assert [f["cause"] for f in failures] == ["killed"]
    group1 = logs(run, 1)
    assert "[r1/0] caught up with a peer" in group1 and "[r1/1] caught up with a peer" in group1, group1[-3000:]
    assert_kept_committing(run, summary, down=1)
    assert_exactly_once(run, summary, 160)
    assert assert_groups_agree(run, 2, tmp_path, since=failures[0]["rejoined_at"]) >= 10
