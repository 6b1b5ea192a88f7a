"""The replica layer's vote, end to end (`freescale local`): a step voted against on every group
or on one, after its peers committed it, or by a group that dies as it votes, leaves no trace: the
runs end bitwise as the same runs without the failures (with every pipeline, TorchRec's PEC
against its sparse-dist one), each batch trained once; and two groups train like one job with
twice the batch. (Crashes and hangs: `test_ft.py`.)"""

import pytest
import torch

from helpers.ft_runs import (FT_LOCAL, assert_exactly_once, assert_groups_agree, commits, differing,
                             final_state, local, logs)
from helpers.launch import check, ranks, train_losses

pytestmark = pytest.mark.slow


def test_an_injected_commit_failure_leaves_no_trace(tmp_path):
    # Both groups vote against steps 4 and 10 (a sync step of TorchRec's tables, every 5 here):
    # the rows the fused optimizer wrote in those steps go back, the dense step is skipped, and
    # the same batches are trained again. The run must end bitwise equal to the clean one
    # (min_replicas 2: every step has both groups).
    args = ["--replicas", "2", "--nproc", "1", "--train.steps=12", "--checkpoint.at_end=true",
            "--ft.min_replicas=2", "--ft.embedding_sync_every=5", "--run.log_every=1"]
    # The prioritized pipeline under the same failures must end bitwise like the clean
    # synchronous run too: its rollback covers the deferred rows, its replay the staged batches.
    # TorchRec's sparse-dist pipeline, whose tables are TorchRec's, against its own clean run.
    for pipeline, reference in (("sync", "sync"), ("prioritized", "sync"), ("sparse_dist", "sparse_dist")):
        clean = tmp_path / f"clean-{reference}"
        if not clean.exists():
            check(local(clean, *args, f"--train.pipeline={reference}")[0])
        failed = tmp_path / f"failed-{pipeline}"
        proc, summary = local(failed, *args, "--fault.fail_commit_at=[4,10]", f"--train.pipeline={pipeline}")
        check(proc)
        for r in range(2):
            log = (failed / f"replica{r}" / "logs" / f"replica{r}-rank0.log").read_text()
            assert "step 4 not committed" in log and "step 10 not committed" in log
            assert train_losses(clean / f"replica{r}") == train_losses(failed / f"replica{r}")
            ref, got = final_state(clean / f"replica{r}", tmp_path), final_state(failed / f"replica{r}", tmp_path)
            assert differing(ref, got, "") == [], pipeline
        assert_exactly_once(failed, summary, 12)


def test_pec_under_the_layer_trains_as_sparse_dist_through_rollbacks_and_a_catch_up(tmp_path):
    # TorchRec's PEC pipeline under the replica layer against TorchRec's sparse-dist pipeline
    # under the same faults, two groups of two ranks: both groups vote against step 4 (the next
    # batch's rows were looked up ahead: batch 4, trained again, writes none of them) and step
    # 10 (a sync step of the tables, every 5 here: they are looked up after its vote); group 1
    # votes against step 12 after the peers committed it, then catches up from group 0 (its
    # tables rewritten: the rows it looked up ahead are read again). Every loss of both groups,
    # and their final states, bitwise the same as sparse_dist's.
    args = ["--replicas", "2", "--nproc", "2", "--train.steps=16", "--checkpoint.at_end=true", "--ft.min_replicas=2",
            "--ft.embedding_sync_every=5", "--run.log_every=1", "--fault.fail_commit_at=[4,10]",
            "--faults=[{fail_commit_at: [12], replicas: [1]}]"]
    runs = {}
    for pipeline in ("sparse_dist", "pec"):
        runs[pipeline] = tmp_path / pipeline
        proc, summary = local(runs[pipeline], *args, f"--train.pipeline={pipeline}")
        check(proc)
        assert_exactly_once(runs[pipeline], summary, 16)
    group1 = logs(runs["pec"], 1)
    assert "step 4 not committed" in group1 and "step 10 not committed" in group1
    assert "step 12 not committed" in group1 and "caught up with a peer at step" in group1
    for r in range(2):
        losses = train_losses(runs["pec"] / f"replica{r}")
        assert sorted(losses) == [step for step in range(1, 17) if r == 0 or step != 12]  # group 1's step 12: group 0's
        assert losses == train_losses(runs["sparse_dist"] / f"replica{r}"), r
        ref = final_state(runs["sparse_dist"] / f"replica{r}", tmp_path)
        # (PEC's module holds the item table's collection one level deeper)
        got = {k.replace("._embedding_collection", ""): v
               for k, v in final_state(runs["pec"] / f"replica{r}", tmp_path).items()}
        assert differing(ref, got, "") == [], r


def test_a_vote_lost_after_the_peers_committed_does_not_train_the_batch_again(tmp_path):
    # Group 1 votes against step 10 after every collective of the step went through: group 0
    # commits it with group 1's batch in. Group 1 is then a step behind, catches up from group 0,
    # and takes from its state that its batch is trained: it goes on to the next one.
    # The prioritized pipeline under the same fault must end bitwise as the synchronous one: it
    # read the next batch's rows before the vote that rewrote its tables with the peer's, so it
    # must read them again.
    runs = {}
    for pipeline in ("sync", "prioritized"):
        run = runs[pipeline] = tmp_path / pipeline
        proc, summary = local(run, "--replicas", "2", "--nproc", "1", "--train.steps=30", "--checkpoint.at_end=true",
                              "--ft.min_replicas=2", "--run.log_every=1", f"--train.pipeline={pipeline}",
                              "--fault.fail_commit_at=[10]", "--fault.replicas=[1]")
        check(proc)
        assert "step 10 not committed (injected commit failure at step 10)" in logs(run, 1)
        assert "caught up with a peer at step 10" in logs(run, 1) and "not committed" not in logs(run, 0)
        # Group 1 commits step 11 with the peers' state, its step-10 batch counted in: it trains the
        # next one at step 12.
        group1 = commits(run, 1)
        assert [c["step"] for c in group1] == [*range(1, 10), *range(11, 31)] and all(c["trained"] for c in group1)
        cursor = {c["step"]: c["next_batch"] for c in group1}
        assert (cursor[9], cursor[11], cursor[12], cursor[30]) == (9, 10, 11, 29)
        assert_exactly_once(run, summary, 30)
        assert_groups_agree(run, 2, tmp_path)
    for r in range(2):
        reference, got = (runs[p] / f"replica{r}" for p in ("sync", "prioritized"))
        assert train_losses(got) == train_losses(reference), r
        assert differing(final_state(reference, tmp_path), final_state(got, tmp_path), "") == [], r


def test_a_group_that_dies_at_its_vote_leaves_its_batch_counted_once(tmp_path):
    # Group 1's process ends as it casts its step-10 vote, after every collective of the step:
    # group 0 commits step 10 with group 1's batch in. The batch is in the model, so group 1's
    # ledger must hold it although the group never saw the commit, and the group, restarted,
    # catches up and goes on with the next batch.
    run = tmp_path / "run"
    proc, summary = local(run, "--replicas", "2", "--nproc", "1", "--train.steps=30", "--checkpoint.at_end=true",
                          "--ft.min_replicas=2", "--fault.at_step=10", "--fault.during=vote", "--fault.kind=exit",
                          "--fault.replicas=[1]")
    check(proc)
    assert [f["at_step"] for f in summary["groups"][1]["failures"]] == [9]
    assert [c["step"] for c in commits(run, 0)] == list(range(1, 31))
    group1 = {c["step"]: c["next_batch"] for c in commits(run, 1)}
    assert group1[9] == 9 and 10 not in group1 and group1[30] == 29  # its step-10 batch is trained once
    assert_exactly_once(run, summary, 30)
    assert_groups_agree(run, 2, tmp_path)


def test_two_groups_of_own_tables_train_like_one_job_with_twice_the_batch(tmp_path):
    # Two groups of one rank, each with its own batch of 16, sum every step's row gradients
    # across the groups: that is one synchronous job of two ranks on the same samples (its
    # global batch k holds the groups' batches 2k and 2k+1), up to the order of float additions.
    # (min_replicas 2: no step without both groups, which one job never has.) After 40 steps the
    # tables are within 4e-6 of the job's; a few dense biases differ by up to 6e-5, Adam's
    # normalized step making much of the last-bit differences of near-zero gradients.
    steps = ["--train.steps=40", "--checkpoint.at_end=true", "--checkpoint.every=0"]
    groups = tmp_path / "groups"
    proc, summary = local(groups, "--replicas", "2", "--nproc", "1", "--ft.min_replicas=2", *steps)
    check(proc)
    one = tmp_path / "one"
    check(ranks(2, "train", "--config", FT_LOCAL, "--ft.enable=false", *steps, f"--run.dir={one}"))
    reference = final_state(one, tmp_path)
    for r in range(2):
        got = final_state(groups / f"replica{r}", tmp_path)
        model = [k for k in reference if k.startswith(("model.", "optimizer."))]
        assert model and all(k in got for k in model)
        for key in model:
            torch.testing.assert_close(got[key], reference[key], rtol=1e-3, atol=1e-4, msg=key)
