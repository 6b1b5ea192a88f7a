"""Declared faults: a rank fails at a chosen step, so recovery and clean-up can be tested.

``fault.at_step: N`` with ``fault.ranks`` (ranks within the replica; empty: every rank) and
``fault.kind``:

- ``raise``: an exception, as a bug or a failed transfer would raise;
- ``exit``: the process ends at once (``os._exit``) as a crash or a kill would: nothing is
  closed or written after it, which is what checkpoints and the ledger must survive;
- ``delay``: the rank stalls for ``fault.delay_s`` seconds there, as a slow or paused host would;
- ``slow``: the rank stalls ``fault.delay_s`` seconds in every step from N on, as a slow host
  would (thermal throttling, a noisy neighbour); it leaves no marker, so it strikes in every
  launch;
- ``hold`` (under the replica layer, at the vote): the group votes against step N, and against
  it again each time it trains it again, until every replica group is in the step (a group
  catching up counts). It keeps joining every quorum meanwhile, so a group that comes back
  meets it there: a barrier across the groups (torchft's tests order events with one, their
  ``EventInjector.barrier_at``), which lets a test count on a restarted group finding a live
  peer however long its restart takes, where a delay would have to outlast it.

``fault.during`` says where in step N: ``step`` (as it begins: the trainer asks), or, under
the replica layer, inside torchft's parts, where wrappers around them strike
(``freescale.ft.faults``): ``quorum`` (the step's quorum), ``allreduce`` (the step's first
cross-replica all-reduce), ``vote`` (after every collective of the step, as the group's
vote is cast: a group that dies there leaves a step its peers commit with its batch in) or
``recover`` (fetching a live peer's state, at the first catch-up at or after step N). Under
the replica layer ``fault.replicas`` picks the groups (empty: every one), and a fault strikes
once per run folder (a marker file under ``faults/``; a hold's once it lets its step pass):
the group, restarted with the same config, goes on.

``faults`` declares more, each a section with ``fault``'s keys: one group exits while another
holds, say. A rank gets every fault declared for it (``Faults``); with none (``at_step: 0``
and no ``fail_commit_at``, the default) the trainer holds a ``NullFaults`` that does nothing.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Sequence


class InjectedFault(RuntimeError):
    """The failure a ``raise`` fault injects."""


class FaultInjector:
    EXIT_CODE = 43  # what an ``exit`` fault ends the process with

    def __init__(self, at_step: int, kind: str, rank: int, during: str = "step", marker: str = "",
                 delay_s: float = 0.0) -> None:
        self.at_step = at_step
        self.kind = kind
        self.rank = rank
        self.during = during
        self.marker = marker  # a file that says the fault has struck ("": no record, it strikes every launch)
        self.delay_s = delay_s
        self._holding = False  # a hold has said on the console that it holds

    def before_step(self, step: int) -> None:
        """``step``: the number the step will have once done (1-based)."""
        self.at("step", step)

    def at(self, point: str, step: int) -> None:
        """Strike if the fault is declared at ``point`` of step ``step`` (a hold is ``hold``'s)."""
        if self.kind == "hold" or point != self.during or (step < self.at_step if point == "recover" or self.kind == "slow"
                                                           else step != self.at_step):
            return
        if self.kind == "slow":
            time.sleep(self.delay_s)
            return
        if self._struck():
            return
        self._mark()
        where = "" if point == "step" else f" during {point}"
        if self.kind == "delay":
            print(f"[fault] rank {self.rank} stalls {self.delay_s:g} s at step {step}{where}", file=sys.stderr, flush=True)
            time.sleep(self.delay_s)
            return
        if self.kind == "exit":
            print(f"[fault] rank {self.rank} exits at step {step}{where}", file=sys.stderr, flush=True)
            os._exit(self.EXIT_CODE)
        raise InjectedFault(f"injected fault at step {step}{where} on rank {self.rank}")

    def hold(self, step: int, groups_in_step: int, groups: int) -> str:
        """At the vote of step ``step``: why a hold declared there keeps the group from committing
        it ("" once every one of ``groups`` is in the step, which lets it pass for good)."""
        if self.kind != "hold" or step != self.at_step or self._struck():
            return ""
        if groups_in_step >= groups:
            self._mark()
            print(f"[fault] rank {self.rank} lets step {step} pass: every replica group is in it",
                  file=sys.stderr, flush=True)
            return ""
        if not self._holding:
            self._holding = True
            print(f"[fault] rank {self.rank} holds at step {step} until every replica group is in it",
                  file=sys.stderr, flush=True)
        return f"injected hold at step {step} until every replica group is in it: {groups_in_step} of {groups} are"

    def _struck(self) -> bool:
        return bool(self.marker) and os.path.exists(self.marker)

    def _mark(self) -> None:
        if self.marker:
            os.makedirs(os.path.dirname(self.marker), exist_ok=True)
            open(self.marker, "w").close()


class Faults:
    """Every fault declared for one rank, in the order declared, and the steps its group votes
    against once (``fail_commit_at``, under the replica layer)."""

    def __init__(self, injectors: list[FaultInjector], fail_commit_at: Sequence[int] = ()) -> None:
        self.injectors = injectors
        self.fail_commit_at = sorted(set(fail_commit_at))

    def before_step(self, step: int) -> None:
        for injector in self.injectors:
            injector.before_step(step)

    def at(self, point: str, step: int) -> None:
        for injector in self.injectors:
            injector.at(point, step)

    def hold(self, step: int, groups_in_step: int, groups: int) -> str:
        """Why a hold keeps the group from committing step ``step`` ("": none does)."""
        return next(filter(None, (i.hold(step, groups_in_step, groups) for i in self.injectors)), "")


class NullFaults:
    fail_commit_at: list[int] = []

    def before_step(self, step: int) -> None:
        pass

    def at(self, point: str, step: int) -> None:
        pass

    def hold(self, step: int, groups_in_step: int, groups: int) -> str:
        return ""


def build_faults(declared: list, rank: int, replica: int | None = None, run_dir: str = ""):
    """The faults of ``declared`` (``fault`` and ``faults`` sections) that strike this rank: those
    with an ``at_step`` whose ``ranks`` hold it (or are empty); under the replica layer
    (``replica`` given) only those whose ``replicas`` hold its group (or are empty), struck once
    per run folder, and their ``fail_commit_at`` steps. A ``NullFaults`` when none does."""
    injectors, fail_commit_at = [], []
    for cfg in declared:
        if replica is not None and cfg.replicas and replica not in cfg.replicas:
            continue
        fail_commit_at += cfg.fail_commit_at
        if not cfg.at_step or (cfg.ranks and rank not in cfg.ranks):
            continue
        marker = ("" if replica is None else
                  os.path.join(run_dir, "faults", f"rank{rank}-{cfg.kind}-{cfg.during}-step{cfg.at_step}"))
        injectors.append(FaultInjector(cfg.at_step, cfg.kind, rank, cfg.during, marker, cfg.delay_s))
    if not injectors and not fail_commit_at:
        return NullFaults()
    return Faults(injectors, fail_commit_at)
