"""The replica layer end to end: `freescale local` starts a lighthouse and replica groups of
torchrun ranks, kills and restarts them; the groups must end in agreement (dense state
bitwise, embedding tables after the final sync) with every sample of every shard trained once."""

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from helpers.launch import REPO, check, freescale, train_losses

pytestmark = pytest.mark.slow

FT_LOCAL = str(REPO / "configs" / "ft_local.yaml")
# Long enough that a group restarted on this 2-core machine (10-20 s to start) rejoins before the end.
LONG = ["--train.steps=600", "--checkpoint.at_end=true"]


def local(run: Path, *args: str, timeout: float = 900):
    proc = freescale("local", "--config", FT_LOCAL, f"--run.dir={run}", *args, timeout=timeout)
    summary_path = run / "local_summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    return proc, summary


def final_state(replica_dir: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The group's last checkpoint, flattened to dotted keys."""
    step_dir = sorted((replica_dir / "checkpoints").iterdir())[-1]
    out = tmp / f"{replica_dir.parent.name}-{replica_dir.name}.pt"
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


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def differing(a: dict, b: dict, prefix: str) -> list[str]:
    keys = [k for k in a if k.startswith(prefix)]
    assert keys and keys == [k for k in b if k.startswith(prefix)]
    return [k for k in keys if not bitwise_equal(a[k], b[k])]


def assert_groups_agree(run: Path, replicas: int, tmp: Path) -> None:
    """Dense weights and optimizer state, embedding rows and their optimizer state: bitwise the same in every group."""
    states = [final_state(run / f"replica{r}", tmp) for r in range(replicas)]
    tables = [k for k in states[0] if k.startswith("model.") and not k.startswith("model.task.")]
    assert any("table" in k for k in tables), tables
    for r in range(1, replicas):
        for part in ("model.task.", "optimizer.", "model."):
            assert differing(states[0], states[r], part) == [], f"replica {r} differs from replica 0 in {part}"


def assert_exactly_once(summary: dict, steps: int) -> None:
    ledger = summary["ledger"]
    assert ledger["samples_lost"] == 0 and ledger["samples_repeated"] == 0 and ledger["unexpected"] == 0, ledger
    for g in summary["groups"]:
        assert g["exit_code"] == 0 and g["last_step"] == steps, g


def commits(run: Path, replica: int) -> list[dict]:
    path = run / f"replica{replica}" / "ft_commits.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_kept_committing(run: Path, summary: dict, down: int, kills_only: bool = False) -> None:
    """While group ``down`` was away, every other group committed steps, and ``down`` trained
    again after every failure.

    ``kills_only``: the first part for kills only. A group that dies while the others send it
    their state holds them in that transfer until its timeout, which can outlast a quick
    restart; they then commit their next step beside it.
    """
    for failure in summary["groups"][down]["failures"]:
        assert failure["rejoined_at"] is not None, failure
        if kills_only and failure["cause"] != "killed":
            continue
        for g in summary["groups"]:
            if g["replica"] != down:
                during = [c for c in commits(run, g["replica"]) if failure["down_at"] < c["time"] < failure["rejoined_at"]]
                assert during, f"replica {g['replica']} committed nothing while replica {down} was down"
    last = commits(run, down)[-1]
    assert last["trained"] and last["step"] == summary["steps"]


@pytest.mark.parametrize("pipeline, extra", [("sparse_dist", ["--balance.enable=true"]), ("sync", [])])
def test_a_killed_group_of_two_ranks_catches_up_and_finishes(tmp_path, pipeline, extra):
    # sparse_dist: TorchRec's tables, the item table row-wise and the user table column-wise
    # over the group's two ranks, with the balancer re-partitioning inside each group;
    # sync: FreeScale's own row-wise tables.
    run = tmp_path / "run"
    proc, summary = local(run, "--replicas", "2", "--nproc", "2", "--kill", "1@10", f"--train.pipeline={pipeline}",
                          *extra, *LONG)
    check(proc)
    failures = summary["groups"][1]["failures"]
    assert [f["cause"] for f in failures] == ["killed"]
    before = [c for c in commits(run, 1) if c["time"] < failures[0]["down_at"] and c["trained"]]
    # Killed once 10 batches of its own shard were trained: the launcher polls the group's
    # cursor every 50 ms, so on a busy machine a step or two more may commit before the kill.
    assert 10 <= len(before) <= 12, len(before)
    assert_kept_committing(run, summary, down=1)
    assert_exactly_once(summary, 600)
    assert_groups_agree(run, 2, tmp_path)


def test_three_groups_survive_a_kill_and_a_kill_during_catch_up(tmp_path):
    # Group 2 is killed at step 10; when it comes back, its rank 0 dies while loading the
    # peer's state (the fault fires once); the third start catches up and finishes.
    run = tmp_path / "run"
    proc, summary = local(run, "--replicas", "3", "--nproc", "1", "--kill", "2@10", "--restart-delay", "0",
                          "--fault.at_step=1", "--fault.during=catch_up", "--fault.kind=exit", "--fault.replicas=[2]",
                          *LONG)
    check(proc)
    causes = [f["cause"] for f in summary["groups"][2]["failures"]]
    assert "killed" in causes and any(c.startswith("exit") for c in causes), causes
    assert "exits at step" in (run / "replica2.console.log").read_text()  # the fault struck during catch-up
    assert_kept_committing(run, summary, down=2, kills_only=True)
    assert_exactly_once(summary, 600)
    assert_groups_agree(run, 3, tmp_path)


# (The sync pipeline's all-reduce is the prioritized one's; its kills and rollbacks are covered above and below.)
@pytest.mark.parametrize("pipeline", ["sparse_dist", "prioritized"])
def test_a_group_killed_inside_the_cross_replica_allreduce(tmp_path, pipeline):
    run = tmp_path / "run"
    # Step 150: both groups are up by then, however far apart they started.
    proc, summary = local(run, "--replicas", "2", "--nproc", "1", "--restart-delay", "0", "--fault.at_step=150",
                          "--fault.during=allreduce", "--fault.kind=exit", "--fault.replicas=[1]",
                          f"--train.pipeline={pipeline}", *LONG)
    check(proc)
    assert "rank 0 exits at step 150 during allreduce" in (run / "replica1.console.log").read_text()
    # Group 0 was waiting in the same all-reduce: its step 150 fails, is rolled back and trained again.
    assert "step 150 not committed" in (run / "replica0" / "logs" / "replica0-rank0.log").read_text()
    steps = [c["step"] for c in commits(run, 0)]
    assert steps == sorted(set(steps)) and 150 in steps  # each step committed once, the failed one included
    assert_kept_committing(run, summary, down=1)
    assert_exactly_once(summary, 600)
    assert_groups_agree(run, 2, tmp_path)


def test_an_injected_commit_failure_leaves_no_trace(tmp_path):
    # Both groups vote against steps 4 and 9: the rows the fused optimizer wrote in those steps
    # go back, the dense step is skipped, and the same batches are trained again. The run must
    # end bitwise equal to the clean one (min_replicas 2: every step has both groups).
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
        proc, summary = local(failed, *args, "--ft.fail_commit_at=[4,9]", f"--train.pipeline={pipeline}")
        check(proc)
        for r in range(2):
            log = (failed / f"replica{r}" / "logs" / f"replica{r}-rank0.log").read_text()
            assert "step 4 not committed" in log and "step 9 not committed" in log
            assert train_losses(clean / f"replica{r}") == train_losses(failed / f"replica{r}")
            ref, got = final_state(clean / f"replica{r}", tmp_path), final_state(failed / f"replica{r}", tmp_path)
            assert differing(ref, got, "") == [], pipeline
        assert_exactly_once(summary, 12)
