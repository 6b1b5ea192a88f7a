"""Declared faults: a rank fails at a chosen step, so recovery and clean-up can be tested.

``fault.at_step: N`` with ``fault.ranks`` (ranks within the replica; empty: every rank) and
``fault.kind``:

- ``raise``: an exception as step N begins, as a bug would raise: ``train()`` closes what it
  opened and the CLI exits 1 naming the cause;
- ``exit``: the process ends at once (``os._exit``) as a crash or a kill would: nothing is
  closed or written after it, which is what checkpoints and the ledger must survive.

``fault.during`` places it inside step N instead of at its start: ``allreduce`` (inside the
cross-replica all-reduce of the replica layer) or ``catch_up`` (while a group that rejoins
loads a peer's state, at its first catch-up at or after step N). Under the replica layer
``fault.replicas`` picks the groups (empty: every one), and a fault fires once per run folder
(a marker file under ``faults/``): the group, restarted with the same config, goes on.

Off (``at_step: 0``, the default) the trainer holds a ``NullFaults`` that does nothing.
"""

from __future__ import annotations

import os
import sys


class InjectedFault(RuntimeError):
    """The failure a ``raise`` fault injects."""


class FaultInjector:
    EXIT_CODE = 43  # what an ``exit`` fault ends the process with

    def __init__(self, at_step: int, kind: str, rank: int, during: str = "step", marker: str = "") -> None:
        self.at_step = at_step
        self.kind = kind
        self.rank = rank
        self.during = during
        self.marker = marker  # a file that says the fault has fired ("": no record, it fires every launch)

    def before_step(self, step: int) -> None:
        """``step``: the number the step will have once done (1-based)."""
        self.at("step", step)

    def at(self, point: str, step: int) -> None:
        """Strike if the fault is declared at ``point`` of step ``step``."""
        if point != self.during or (step < self.at_step if point == "catch_up" else step != self.at_step):
            return
        if self.marker:
            if os.path.exists(self.marker):
                return
            os.makedirs(os.path.dirname(self.marker), exist_ok=True)
            open(self.marker, "w").close()
        where = "" if point == "step" else f" during {point.replace('_', '-')}"
        if self.kind == "exit":
            print(f"[fault] rank {self.rank} exits at step {step}{where}", file=sys.stderr, flush=True)
            os._exit(self.EXIT_CODE)
        raise InjectedFault(f"injected fault at step {step}{where} on rank {self.rank}")


class NullFaults:
    def before_step(self, step: int) -> None:
        pass

    def at(self, point: str, step: int) -> None:
        pass


def build_faults(cfg, rank: int, replica: int | None = None, run_dir: str = ""):
    """A FaultInjector when ``cfg.at_step`` is set and this rank is one of ``cfg.ranks`` (or they
    are empty); under the replica layer (``replica`` given) also one of ``cfg.replicas``, fired
    once per run folder."""
    if not cfg.at_step or (cfg.ranks and rank not in cfg.ranks):
        return NullFaults()
    if replica is None:
        return FaultInjector(cfg.at_step, cfg.kind, rank, cfg.during)
    if cfg.replicas and replica not in cfg.replicas:
        return NullFaults()
    marker = os.path.join(run_dir, "faults", f"rank{rank}-{cfg.during}-step{cfg.at_step}")
    return FaultInjector(cfg.at_step, cfg.kind, rank, cfg.during, marker)
