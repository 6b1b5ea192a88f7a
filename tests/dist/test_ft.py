"""The replica layer end to end: `freescale local` starts a lighthouse and replica groups of
torchrun ranks, injects faults, kills and restarts them; the groups must agree (dense state and
tables bitwise, at every checkpoint they both took after a rejoin, not only at the end), every
sample of every shard must be trained once, and the run must reach its last step."""

import datetime
import json
import os
import re
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from freescale.local import descendants
from helpers.launch import REPO, check, freescale, start_freescale, torchrun, train_losses

pytestmark = pytest.mark.slow

FT_LOCAL = str(REPO / "configs" / "ft_local.yaml")
BATCH_SIZE = 16  # configs/ft_local.yaml's data.batch_size, which no test here changes
# A checkpoint every 7 steps: none of them is a step the TorchRec tables' sync falls on by its
# own schedule (every 10), and every group keeps them all to be compared.
EVERY_7 = ["--checkpoint.every=7", "--checkpoint.keep=1000", "--ft.embedding_sync_every=10"]


def local(run: Path, *args: str, timeout: float = 900):
    proc = freescale("local", "--config", FT_LOCAL, f"--run.dir={run}", *args, timeout=timeout)
    summary_path = run / "local_summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    return proc, summary


def load_checkpoint(step_dir: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """A checkpoint, flattened to dotted keys."""
    out = tmp / f"{step_dir.parent.parent.parent.name}-{step_dir.parent.parent.name}-{step_dir.name}.pt"
    dcp_to_torch_save(str(step_dir), str(out))
    flat = {}

    def walk(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            elif isinstance(v, torch.Tensor):
                flat[prefix + k] = v

    walk(torch.load(out, weights_only=False))
    return flat


def final_state(replica_dir: Path, tmp: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(sorted((replica_dir / "checkpoints").iterdir())[-1], tmp)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def differing(a: dict, b: dict, prefix: str) -> list[str]:
    keys = [k for k in a if k.startswith(prefix) and k != "data.next_batch"]  # each group's own position
    assert keys and keys == [k for k in b if k.startswith(prefix) and k != "data.next_batch"]
    return [k for k in keys if not bitwise_equal(a[k], b[k])]


def assert_groups_agree(run: Path, replicas: int, tmp: Path, since: float = 0.0) -> int:
    """Dense weights and optimizer state, embedding rows and their optimizer state, every group's
    data cursor: bitwise the same in every group at the first three checkpoint steps they all
    hold that were written after ``since`` (a time), and at the last; how many steps they share."""
    steps = None
    for r in range(replicas):
        mine = {p.name for p in (run / f"replica{r}" / "checkpoints").iterdir()
                if p.name.startswith("step_") and p.stat().st_mtime > since}
        steps = mine if steps is None else steps & mine
    assert steps, "no checkpoint step every group holds"
    shared = sorted(steps)
    for step in sorted(set(shared[:3] + shared[-1:])):
        states = [load_checkpoint(run / f"replica{r}" / "checkpoints" / step, tmp) for r in range(replicas)]
        assert any(k.startswith("model.") and not k.startswith("model.task.") for k in states[0])  # the tables
        for r in range(1, replicas):
            assert differing(states[0], states[r], "") == [], f"replica {r} differs from replica 0 at {step}"
    return len(shared)


def synthetic_batch(global_batch: int):
    """The sample ids of a global batch of the synthetic stream, whose ids are its positions."""
    return lambda k: range(k * global_batch, (k + 1) * global_batch)


def assert_exactly_once(run: Path, summary: dict, steps: int, batch_ids=None) -> None:
    """Read here from the files every group wrote (its ledgers and its data cursor), not taken
    from the launcher: every batch of every group's shard before its cursor trained once across
    its ranks, each sample of it once (``batch_ids(k)``: the ids global batch ``k`` holds; by
    default the synthetic stream's), nothing else trained, every group at the last step. Then the
    launcher's ledger check must say the same."""
    replicas, nproc = summary["replicas"], summary["ranks_per_replica"]
    batch_ids = batch_ids or synthetic_batch(BATCH_SIZE * nproc)
    batches = 0
    for g in range(replicas):
        folder = run / f"replica{g}"
        cursor = json.loads((folder / "ft_cursor.json").read_text())
        assert cursor["step"] == steps, (g, cursor)
        mine = [p * replicas + g for p in range(cursor["next_batch"])]  # its shard, from the start
        trained = {}
        for path in sorted((folder / "ledger").glob("*.jsonl")):
            for record in map(json.loads, path.read_text().splitlines()):
                trained.setdefault(record["batch"], Counter()).update(record["sample_ids"])
        assert sorted(trained) == mine, (g, sorted(set(trained) ^ set(mine))[:10])
        for k in mine:
            assert trained[k] == Counter(batch_ids(k)), (g, k, trained[k] - Counter(batch_ids(k)),
                                                         Counter(batch_ids(k)) - trained[k])
        batches += len(mine)
    assert summary["ledger"] == {"samples_lost": 0, "samples_repeated": 0, "unexpected": 0, "unfinished": [],
                                 "complete": True, "batches": batches}, summary["ledger"]
    for g in summary["groups"]:
        assert g["exit_code"] == 0 and g["last_step"] == steps, g


def commits(run: Path, replica: int) -> list[dict]:
    path = run / f"replica{replica}" / "ft_commits.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def logs(run: Path, replica: int) -> str:
    return "".join(p.read_text() for p in sorted((run / f"replica{replica}" / "logs").iterdir()))


def failure_lines(run: Path, groups: list[int]) -> str:
    return "\n".join(line[:300] for g in groups for line in logs(run, g).splitlines()
                     if re.search(r"collective failed|giving up|not committed", line))


def assert_commit_soon_after(run: Path, groups: list[int], failed_at: float, step: int, within_s: float = 2.0) -> None:
    """Every group in ``groups`` committed a step within ``within_s`` of a failure, and once
    each step (``step``, the failed one, included)."""
    for g in groups:
        after = [c["time"] - failed_at for c in commits(run, g) if c["time"] > failed_at]
        assert after and after[0] <= within_s, (f"replica {g}: first commit {after[:1]} s after the failure; "
                                                f"what the groups logged of it:\n{failure_lines(run, groups)}")
        steps = [c["step"] for c in commits(run, g)]
        assert steps == sorted(set(steps)) and step in steps


def assert_kept_committing(run: Path, summary: dict, down: int) -> None:
    """While group ``down`` was away, every other group committed steps, and ``down`` trained
    again after every failure."""
    for failure in summary["groups"][down]["failures"]:
        assert failure["rejoined_at"] is not None, failure
        for g in summary["groups"]:
            if g["replica"] != down:
                during = [c for c in commits(run, g["replica"]) if failure["down_at"] < c["time"] < failure["rejoined_at"]]
                assert during, f"replica {g['replica']} committed nothing while replica {down} was down"
    last = commits(run, down)[-1]
    assert last["trained"] and last["step"] == summary["steps"]


@pytest.mark.parametrize("pipeline, extra", [("sparse_dist", ["--balance.enable=true"]), ("sync", [])])
def test_a_killed_group_of_two_ranks_catches_up_group_atomically_and_finishes(tmp_path, pipeline, extra):
    # sparse_dist: TorchRec's tables, the item table row-wise and the user table column-wise
    # over the group's two ranks, with the balancer re-partitioning inside each group;
    # sync: FreeScale's own row-wise tables. Group 1's first catch-up fails on its rank 0 while
    # its rank 1 fetches and holds the peer's state: the group must drop it on both ranks and
    # catch up again, never half.
    # Group 0 holds at step 60 until group 1 is back in the step (a hold: it votes against the
    # step until every group is in it), so the restart (10 s and more on a busy machine) finds a
    # live group to catch up from, however fast group 0 trains its remaining steps alone.
    run = tmp_path / "run"
    proc, summary = local(run, "--replicas", "2", "--nproc", "2", "--kill", "1@10", f"--train.pipeline={pipeline}",
                          "--fault.at_step=1", "--fault.during=recover", "--fault.kind=raise", "--fault.ranks=[0]",
                          "--fault.replicas=[1]", "--faults=[{at_step: 60, during: vote, kind: hold, replicas: [0]}]",
                          *extra, *EVERY_7, "--train.steps=160", "--checkpoint.at_end=true")
    check(proc)
    failures = summary["groups"][1]["failures"]
    assert [f["cause"] for f in failures] == ["killed"]
    before = [c for c in commits(run, 1) if c["time"] < failures[0]["down_at"] and c["trained"]]
    # Killed once 10 batches of its own shard were trained: the launcher polls the group's
    # cursor every 50 ms and steps here take 15-60 ms, so on a busy machine (the launcher
    # waiting for a core) a few steps more may commit before the kill.
    assert 10 <= len(before) <= 20, len(before)
    # Rank 0's fetch failed; rank 1's did not, and it dropped what it fetched at the group's vote.
    group1 = logs(run, 1)
    assert re.search(r"\[r1/0\] (step \d+ not committed|catching up in step \d+ failed) \(injected fault at step "
                     r"\d+ during recover on rank 0\)", group1), group1[-3000:]
    assert re.search(r"\[r1/1\] (step \d+ not committed|catching up in step \d+ failed) \(the ranks of replica 1 "
                     r"disagree", group1), group1[-3000:]
    assert len(re.findall(r"\[r1/1\] caught up with a peer", group1)) == len(re.findall(r"\[r1/0\] caught up", group1))
    assert_kept_committing(run, summary, down=1)
    assert_exactly_once(run, summary, 160)
    # From the first checkpoint after group 1 came back on: the two groups' states, tables
    # included, at steps that are no sync step of TorchRec's tables but checkpoint steps.
    assert assert_groups_agree(run, 2, tmp_path, since=failures[0]["rejoined_at"]) >= 10


def test_survivors_go_on_at_once_when_a_group_dies_inside_the_allreduce(tmp_path):
    # Three groups of one rank: group 2 exits inside a cross-replica all-reduce of step 150 and
    # is restarted 5 s later. The two others must not wait for it: they form a quorum of two
    # as soon as the lighthouse stops hearing from it. Holds order the rest by events: every
    # group holds at step 1 (all three are in step 150), and groups 0 and 1 hold at step 200
    # until group 2 is back, however long its restart takes on a busy machine.
    run = tmp_path / "run"
    proc, summary = local(run, "--replicas", "3", "--nproc", "1", "--restart-delay", "5", "--fault.at_step=150",
                          "--fault.during=allreduce", "--fault.kind=exit", "--fault.replicas=[2]",
                          "--faults=[{at_step: 1, during: vote, kind: hold},"
                          " {at_step: 200, during: vote, kind: hold, replicas: [0, 1]}]",
                          "--train.steps=260", "--checkpoint.at_end=true")
    check(proc)
    assert "rank 0 exits at step 150 during allreduce" in (run / "replica2.console.log").read_text()
    (failure,) = summary["groups"][2]["failures"]
    assert_commit_soon_after(run, [0, 1], failure["down_at"], step=150)
    assert_kept_committing(run, summary, down=2)
    assert_exactly_once(run, summary, 260)
    assert_groups_agree(run, 3, tmp_path)


def test_a_group_whose_allreduce_fails_releases_the_others_at_once(tmp_path):
    # Three groups of one rank: group 1's part of the first cross-replica all-reduce of step 50
    # fails (it raises before sending anything, as a failing link would), and it goes on living.
    # The others are already in that all-reduce, waiting for its data: group 1 aborts the
    # collective, which fails their side at once, instead of leaving them blocked until the
    # collective's timeout (10 s); every group trains step 50 again and commits it.
    run = tmp_path / "run"
    proc, summary = local(run, "--replicas", "3", "--nproc", "1", "--fault.at_step=50", "--fault.during=allreduce",
                          "--fault.kind=raise", "--fault.replicas=[1]", "--ft.min_replicas=3", "--train.steps=100",
                          "--checkpoint.at_end=true")
    check(proc)
    (stamp,) = re.findall(r"^(\S+ \S+) \[r1/0\] a cross-replica collective failed \(injected fault at step 50",
                          logs(run, 1), re.M)
    failed_at = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
    assert_commit_soon_after(run, [0, 1, 2], failed_at, step=50)
    for g in range(3):
        assert "step 50 not committed" in logs(run, g)
        steps = [c["step"] for c in commits(run, g)]
        assert steps == list(range(1, 101)), g  # (min_replicas 3: the three start together)
    assert_exactly_once(run, summary, 100)
    assert_groups_agree(run, 3, tmp_path)


# (The sync pipeline's all-reduce is the prioritized one's; its kills and rollbacks are covered above and below.)
@pytest.mark.parametrize("pipeline", ["sparse_dist", "prioritized"])
def test_a_group_killed_inside_the_cross_replica_allreduce(tmp_path, pipeline):
    run = tmp_path / "run"
    # Group 1 exits inside the all-reduce of step 60 and is restarted at once; group 0 trains on
    # alone. The order of events is held by holds (a group votes against its step until every
    # group is in it), not by guesses of how long things take: both groups hold at step 1, so
    # group 1 trains step 60 itself rather than catching up past it when it starts late; group 0
    # holds at step 120, so group 1's restart (a process start and imports: 10 s and more on a
    # busy machine, longer than the steps group 0 has left) finds a live group to catch up
    # from instead of a finished run.
    proc, summary = local(run, "--replicas", "2", "--nproc", "1", "--restart-delay", "0", "--fault.at_step=60",
                          "--fault.during=allreduce", "--fault.kind=exit", "--fault.replicas=[1]",
                          "--faults=[{at_step: 1, during: vote, kind: hold},"
                          " {at_step: 120, during: vote, kind: hold, replicas: [0]}]",
                          f"--train.pipeline={pipeline}", "--train.steps=180", "--checkpoint.at_end=true")
    check(proc)
    assert "rank 0 exits at step 60 during allreduce" in (run / "replica1.console.log").read_text()
    # Group 0 was waiting in the same all-reduce: its step 60 fails, is rolled back and trained again.
    assert "step 60 not committed" in logs(run, 0)
    steps = [c["step"] for c in commits(run, 0)]
    assert steps == sorted(set(steps)) and 60 in steps
    assert_kept_committing(run, summary, down=1)
    (failure,) = summary["groups"][1]["failures"]
    back = [c["step"] for c in commits(run, 1) if c["time"] > failure["down_at"]]
    assert back[0] <= 120, back[:1]  # it caught up before group 0 went past its hold
    assert_exactly_once(run, summary, 180)
    assert_groups_agree(run, 2, tmp_path)


def test_every_group_killed_at_once_resumes_from_the_newest_checkpoint(tmp_path):
    # Both groups are SIGKILLed at once once one has trained 60 batches of its shard, past the
    # checkpoint of step 50 (every 25 steps in this run); they come back with no live group to
    # catch up from, resume from the job's newest checkpoint, train what followed it again and
    # finish, each batch once.
    run = tmp_path / "run"
    proc, summary = local(run, "--replicas", "2", "--nproc", "1", "--kill", "all@60", "--checkpoint.every=25",
                          "--checkpoint.keep=20", "--train.steps=200", "--checkpoint.at_end=true")
    check(proc)
    for g in summary["groups"]:
        assert [f["cause"] for f in g["failures"]] == ["killed"]
    # Killed once one group had committed 60 steps; the other may not have written its last
    # commit yet, but both were past the checkpoint.
    at = [g["failures"][0]["at_step"] for g in summary["groups"]]
    assert max(at) >= 60 and min(at) > 50, at
    resumed = [int(s) for s in re.findall(r"resumed from the newest checkpoint of the job, step (\d+)",
                                          logs(run, 0) + logs(run, 1))]
    assert resumed and all(s >= 50 for s in resumed), resumed
    # The job went on from there: the first step committed after the kill is the one after it
    # (a group that came back later caught up from one that resumed).
    killed = min(g["failures"][0]["down_at"] for g in summary["groups"])
    first = min(c["step"] for g in range(2) for c in commits(run, g) if c["time"] > killed)
    assert first == max(resumed) + 1, (first, resumed)
    # The steps after the checkpoint were trained twice in wall time, but the ledger holds them once.
    assert_exactly_once(run, summary, 200)
    assert_groups_agree(run, 2, tmp_path, since=min(g["failures"][0]["down_at"] for g in summary["groups"]))


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
    check(torchrun(2, "train", "--config", FT_LOCAL, "--ft.enable=false", *steps, f"--run.dir={one}"))
    reference = final_state(one, tmp_path)
    for r in range(2):
        got = final_state(groups / f"replica{r}", tmp_path)
        model = [k for k in reference if k.startswith(("model.", "optimizer."))]
        assert model and all(k in got for k in model)
        for key in model:
            torch.testing.assert_close(got[key], reference[key], rtol=1e-3, atol=1e-4, msg=key)


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_terminated_launcher_leaves_no_process_behind(tmp_path):
    # SIGTERM (a job scheduler's stop, `timeout`) to `freescale local` while its groups train:
    # every torchrun agent and rank goes with it.
    run = tmp_path / "run"
    proc = start_freescale("local", "--config", FT_LOCAL, f"--run.dir={run}", "--replicas", "2", "--nproc", "1")
    deadline = time.time() + 180
    while not all((run / f"replica{r}" / "ft_cursor.json").exists() for r in range(2)):  # both groups commit
        assert proc.poll() is None and time.time() < deadline, proc.returncode
        time.sleep(0.2)
    below = descendants(proc.pid)
    try:
        assert len(below) >= 4, below  # two agents, a rank each
        proc.terminate()
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.time() + 30
        while any(running(pid) for pid in below) and time.time() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in below if running(pid)]
    finally:  # (what a failure left behind must not load the tests that follow)
        for pid in [proc.pid, *below]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


def test_groups_on_prepared_parquet_data_lose_no_sample_across_a_kill(tmp_path):
    # Two groups of one rank on a prepared dataset of 300 samples (row groups of 24, files of 50:
    # every epoch crosses them all); group 1 is killed once it has trained 10 batches of its
    # shard, catches up from group 0 and finishes. The reference is the files' own ids, read
    # with pyarrow: batch k holds positions 16k .. 16k+15 (mod 300), group g trains k = g, g+2, ...
    from helpers.prepared import batches_of, train_ids, write_synthetic_prepared

    data = write_synthetic_prepared(tmp_path / "data", FT_LOCAL, [], n_train=300)
    run = tmp_path / "run"
    proc, summary = local(run, "--replicas", "2", "--nproc", "1", "--kill", "1@10", "--data.source=parquet",
                          f"--data.path={data}", "--train.steps=300", "--checkpoint.at_end=true")
    check(proc)
    assert [f["cause"] for f in summary["groups"][1]["failures"]] == ["killed"]
    ids = train_ids(data)
    assert_exactly_once(run, summary, 300, batch_ids=lambda k: batches_of(ids, [k], 16)[k])


def test_the_survivors_of_a_hung_group_go_on_within_two_seconds_and_it_catches_up_when_it_wakes(tmp_path):
    # Three groups of one rank; every process of group 2 is SIGSTOPped 1.5 s after it has trained
    # 20 batches (its sockets stay open: a hang, not a crash) and SIGCONTed 15 s later. Group 2
    # stalls 4 s inside the first all-reduce of step 21, the others waiting in it, so the stop
    # lands there and not between two steps, where the lighthouse alone drops a silent group
    # from the next quorum (a stop at once could strike before group 2 asked for step 21's
    # quorum). Holds order the rest
    # by events: every group holds at step 1 (all three are in step 20), and groups 0 and 1 hold
    # at step 250 until group 2 is back, so it wakes to a live run however long it slept.
    run = tmp_path / "run"
    proc, summary = local(run, "--replicas", "3", "--nproc", "1", "--stop", "2@20+1.5:15",
                          "--faults=[{at_step: 1, during: vote, kind: hold},"
                          " {at_step: 21, during: allreduce, kind: delay, delay_s: 4, replicas: [2]},"
                          " {at_step: 250, during: vote, kind: hold, replicas: [0, 1]}]",
                          "--train.steps=270", "--checkpoint.at_end=true")
    check(proc)
    (failure,) = summary["groups"][2]["failures"]
    assert failure["cause"] == "stopped" and failure["restart_delay_s"] >= 15
    stopped, continued = failure["down_at"], failure["down_at"] + failure["restart_delay_s"]
    for g in (0, 1):
        times = [c["time"] for c in commits(run, g)]
        held = next(c["time"] for c in commits(run, g) if c["step"] == 249)  # (from then on it holds)
        end = min(continued, held)
        assert end - stopped > 5, (stopped, end)  # the window holds the detection and steps after it
        window = [stopped] + [t for t in times if stopped < t <= end]
        assert len(window) > 20, window
        # The acceptance itself is a time bound: with group 2 hung, the others commit again
        # within 2 s of its last heartbeat (the stop: it beats every 0.1 s until then) and never
        # go 2 s without a commit while it is stopped (ft.hang_timeout_s is 1 s; the collective
        # timeout, ft.timeout_s, 10 s), measured from the commit times the groups write.
        assert max(b - a for a, b in zip(window, window[1:])) < 2.0, (g, window[:3])
        assert failure["stall_s"][f"replica{g}"] > 0
        # (by the watchdog: the others were in the all-reduce with group 2 when it stopped)
        assert re.search(rf"\[r{g}/0\] giving up quorum \d+'s collectives: replica group replica2 of quorum \d+ "
                         rf"sent no heartbeat", logs(run, g))
    # Group 2 woke in a step it did not commit (the others gave it up; or it was stopped between
    # two steps), caught up from a peer once, in its first commit, and went on.
    assert len(re.findall(r"caught up with a peer", logs(run, 2))) == 1
    woke = [c for c in commits(run, 2) if c["time"] > continued]
    assert [c["trained"] for c in woke] == [False] + [True] * (len(woke) - 1), woke[:3]
    steps = [c["step"] for c in commits(run, 2)]
    assert steps == sorted(set(steps)) and steps[-1] == 270
    assert_exactly_once(run, summary, 270)
    assert summary["slow"] == []  # a hung group is not a slow one
    assert_groups_agree(run, 3, tmp_path, since=failure["rejoined_at"])
