"""The ledger of trained samples: which sample ids each rank trained at each step.

With ``train.ledger: true`` every rank appends one JSON line per step to
``<run>/ledger/replica<R>-rank<r>.jsonl``: ``{"step", "replica", "rank", "batch",
"sample_ids"}``. It is the instrument for exactly-once claims: over a run, every sample of
every global batch trained must appear once across the ranks, however the balancer moved
it, and across restarts. A launch cuts its ledger back to the batches the state it starts
from has trained (``keep_before``: its data cursor; the records of later batches go, since
those batches are trained again), by batch and not by step: a group that took a peer's
state or a checkpoint of another group counts its steps from there.

``audit`` is the check, a pure function: given the records and the sample ids each global
batch holds, it counts samples lost and samples repeated, and says whether the run reached
its last step at all.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from freescale.io import rewind_jsonl

LEDGER_DIR = "ledger"


def ledger_path(run_dir: str, replica: int, rank: int) -> str:
    return os.path.join(run_dir, LEDGER_DIR, f"replica{replica}-rank{rank}.jsonl")


class Ledger:
    def __init__(self, run_dir: str, *, replica: int, rank: int, keep_before: int, position_after) -> None:
        """``keep_before``: the data cursor the launch starts from; ``position_after(batch)``:
        the cursor that follows a global batch of this group's shard."""
        self.path = ledger_path(run_dir, replica, rank)
        self.replica = replica
        self.rank = rank
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        rewind_jsonl(self.path, lambda record: position_after(record["batch"]) <= keep_before)
        self._file = open(self.path, "a")
        self._entered: int | None = None  # a batch written as it entered a step not yet committed

    def entering(self, step: int, batch: int, sample_ids: torch.Tensor) -> None:
        """Under the replica layer: ``batch`` enters ``step``'s cross-replica collectives, after
        which the peers may commit it even if this rank dies before its own vote; so it is
        written now. Written once however often the step is tried; the trainer's ``record`` at
        the commit confirms it. A record of a batch that no committed step holds is dropped at
        the group's next start (``keep_before``: the committed cursor)."""
        if batch != self._entered:
            self._write(step, batch, sample_ids)
            self._entered = batch

    def record(self, step: int, batch: int, sample_ids: torch.Tensor) -> None:
        """A batch trained in the committed ``step``."""
        if batch == self._entered:
            self._entered = None
            return
        self._write(step, batch, sample_ids)

    def _write(self, step: int, batch: int, sample_ids: torch.Tensor) -> None:
        """Flushed at once, so a crash loses no step that completed."""
        self._file.write(json.dumps({"step": step, "replica": self.replica, "rank": self.rank, "batch": int(batch),
                                     "sample_ids": sample_ids.tolist()}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class NullLedger:
    """The ledger off: nothing is recorded."""

    def entering(self, step: int, batch: int, sample_ids) -> None:
        pass

    def record(self, step: int, batch: int, sample_ids) -> None:
        pass

    def close(self) -> None:
        pass


def build_ledger(enable: bool, run_dir: str, *, replica: int, rank: int, keep_before: int, position_after):
    if not enable:
        return NullLedger()
    return Ledger(run_dir, replica=replica, rank=rank, keep_before=keep_before, position_after=position_after)


def read_ledger(run_dir: str) -> list[dict]:
    """Every record of every rank's ledger in a run folder."""
    folder = os.path.join(run_dir, LEDGER_DIR)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"no ledger in {run_dir} (train with train.ledger=true)")
    records = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".jsonl"):
            with open(os.path.join(folder, name)) as f:
                records.extend(json.loads(line) for line in f if line.strip())
    return records


def expected_samples(cfg, batches, ranks: int) -> dict[int, list[int]]:
    """The sample ids of each global batch in ``batches`` (``ranks`` x ``data.batch_size`` samples each)."""
    from freescale.data.loader import BatchLoader, build_sources

    source, _ = build_sources(cfg.data, cfg.run.seed, task=cfg.task)
    loader = BatchLoader(source, batch_size=cfg.data.batch_size, rank=0, world_size=ranks, user_hash_size=1)
    return {int(k): source.samples_at(loader.global_positions(int(k))).sample_ids.tolist() for k in batches}


def audit(records: list[dict], expected: dict[int, list[int]], *, reached: dict | None = None,
          last_step: int | None = None) -> dict:
    """Samples lost and repeated: ``expected`` maps each global batch to its sample ids.

    A sample is lost when a batch it belongs to is in ``expected`` and no rank trained it;
    repeated for each time beyond the first that it was trained in that batch (on any rank,
    at any step). Records of batches not in ``expected`` count as ``unexpected``. With
    ``reached`` (each replica group's last committed step) and ``last_step``, the groups that
    stopped short of it are ``unfinished``, and the run is ``complete`` only if none did:
    nothing lost in the batches a run got to is not a finished run.
    """
    trained: dict[int, Counter] = {}
    unexpected = 0
    for r in records:
        if r["batch"] not in expected:
            unexpected += len(r["sample_ids"])
            continue
        trained.setdefault(r["batch"], Counter()).update(r["sample_ids"])
    lost = repeated = 0
    for batch, ids in expected.items():
        counts = trained.get(batch, Counter())
        members = set(ids)
        lost += sum(1 for i in members if counts[i] == 0)
        repeated += sum(n - 1 for i, n in counts.items() if i in members and n > 1)
        unexpected += sum(n for i, n in counts.items() if i not in members)
    result = {"samples_lost": lost, "samples_repeated": repeated, "unexpected": unexpected}
    if reached is not None and last_step is not None:
        unfinished = sorted(g for g, step in reached.items() if step < last_step)
        result.update(unfinished=unfinished, complete=not unfinished)
    return result


def exactly_once(result: dict) -> bool:
    """An audit that found every sample trained once, in a run that finished (when it says)."""
    return (result["samples_lost"] == 0 and result["samples_repeated"] == 0 and result["unexpected"] == 0
            and result.get("complete", True))
