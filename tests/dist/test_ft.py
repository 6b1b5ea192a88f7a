"""The replica layer through crashes and hangs, end to end: `freescale local` starts a
lighthouse and replica groups of torchrun ranks, kills, stops and restarts them; the groups must
agree (dense state and tables bitwise, at every checkpoint they both took after a rejoin, not
only at the end), every sample of every shard must be trained once, the survivors must go on at
once, and the run must reach its last step. (Votes against a step: `test_ft_votes.py`.)"""

import datetime
import os
import re
import signal
import time

import pytest

from freescale.local import descendants
from helpers.ft_runs import (EVERY_7, FT_LOCAL, assert_commit_soon_after, assert_exactly_once,
                             assert_groups_agree, assert_kept_committing, commits, local, logs, running)
from helpers.launch import check, start_freescale

pytestmark = pytest.mark.slow


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
    # finish, each batch once. Both hold at step 1 until the other is in it: on a busy machine
    # one group's start-up can take as long as the other's first 60 steps alone.
    run = tmp_path / "run"
    proc, summary = local(run, "--replicas", "2", "--nproc", "1", "--kill", "all@60", "--checkpoint.every=25",
                          "--checkpoint.keep=20", "--train.steps=200", "--checkpoint.at_end=true",
                          "--faults=[{at_step: 1, during: vote, kind: hold}]")
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


def test_groups_on_prepared_parquet_data_lose_no_sample_across_a_kill(tmp_path):
    # Two groups of one rank on a prepared dataset of 300 samples (row groups of 24, files of 50:
    # every epoch crosses them all; 120 steps of both groups are 12 epochs); group 1 is killed
    # once it has trained 10 batches of its shard, catches up from group 0 and finishes. Group 0
    # holds at step 60 until group 1 is back in the step, so the restart finds a live group
    # however long it takes. The reference is the files' own ids, read with pyarrow: batch k
    # holds positions 16k .. 16k+15 (mod 300), group g trains k = g, g+2, ...
    from helpers.prepared import batches_of, train_ids, write_synthetic_prepared

    data = write_synthetic_prepared(tmp_path / "data", FT_LOCAL, [], n_train=300)
    run = tmp_path / "run"
    proc, summary = local(run, "--replicas", "2", "--nproc", "1", "--kill", "1@10", "--data.source=parquet",
                          f"--data.path={data}", "--faults=[{at_step: 60, during: vote, kind: hold, replicas: [0]}]",
                          "--train.steps=120", "--checkpoint.at_end=true")
    check(proc)
    assert [f["cause"] for f in summary["groups"][1]["failures"]] == ["killed"]
    ids = train_ids(data)
    assert_exactly_once(run, summary, 120, batch_ids=lambda k: batches_of(ids, [k], 16)[k])


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
