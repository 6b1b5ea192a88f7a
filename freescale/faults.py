"""Declared faults: a rank fails at a chosen step, so recovery and clean-up can be tested.

``fault.at_step: N`` with ``fault.ranks`` (ranks within the replica; empty: every rank) and
``fault.kind``:

- ``raise``: an exception as step N begins, as a bug would raise: ``train()`` closes what it
  opened and the CLI exits 1 naming the cause;
- ``exit``: the process ends at once (``os._exit``) as a crash or a kill would: nothing is
  closed or written after it, which is what checkpoints and the ledger must survive.

``fault.during`` places it inside step N instead of at its start: ``allreduce`` (inside the
cross-replica all-reduce of the replica layer) or ``catch_up`` (while a rejoining replica loads
a peer's state).

Off (``at_step: 0``, the default) the trainer holds a ``NullFaults`` that does nothing.
"""

from __future__ import annotations

import os
import sys


class InjectedFault(RuntimeError):
    """The failure a ``raise`` fault injects."""


class FaultInjector:
    EXIT_CODE = 43  # what an ``exit`` fault ends the process with

    def __init__(self, at_step: int, kind: str, rank: int, during: str = "step") -> None:
        self.at_step = at_step
        self.kind = kind
        self.rank = rank
        self.during = during

    def before_step(self, step: int) -> None:
        """``step``: the number the step will have once done (1-based)."""
        self.at("step", step)

    def at(self, point: str, step: int) -> None:
        """Strike if the fault is declared at ``point`` of step ``step``."""
        if step != self.at_step or point != self.during:
            return
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


def build_faults(cfg, rank: int):
    """A FaultInjector when ``cfg.at_step`` is set and this rank is one of ``cfg.ranks`` (or they are empty)."""
    if cfg.at_step and (not cfg.ranks or rank in cfg.ranks):
        return FaultInjector(cfg.at_step, cfg.kind, rank, cfg.during)
    return NullFaults()
