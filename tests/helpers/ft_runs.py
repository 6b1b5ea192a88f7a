"""What the replica-layer tests share: `freescale local` runs and the checks made on what the
groups wrote (their checkpoints, ledgers, data cursors, commit records and logs), each read here
from the files, independently of the code under test."""

import json
import re
from collections import Counter
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from helpers.launch import REPO, freescale

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


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
