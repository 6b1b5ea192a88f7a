"""Declared faults: a rank fails at a chosen step, so recovery and clean-up can be tested.

``fault.at_step: N`` with ``fault.ranks`` (ranks within the replica; empty: every rank) and
``fault.kind``:

- ``raise``: an exception as step N begins, as a bug would raise: ``train()`` closes what it
  opened and the CLI exits 1 naming the cause;
- ``exit``: the process ends at once (``os._exit``) as a crash or a kill would: nothing is
  closed or written after it, which is what checkpoints and the ledger must survive.

Off (``at_step: 0``, the default) the trainer holds a ``NullFaults`` that does nothing.
"""

from __future__ import annotations

import os
import sys


class InjectedFault(RuntimeError):
    """The failure a ``raise`` fault injects."""


class FaultInjector:
    EXIT_CODE = 43  # what an ``exit`` fault ends the process with

    def __init__(self, at_step: int, kind: str, rank: int) -> None:
        self.at_step = at_step
        self.kind = kind
        self.rank = rank

    def before_step(self, step: int) -> None:
        """``step``: the number the step will have once done (1-based)."""
        if step != self.at_step:
            return
        if self.kind == "exit":
            print(f"[fault] rank {self.rank} exits at step {step}", file=sys.stderr, flush=True)
            os._exit(self.EXIT_CODE)
        raise InjectedFault(f"injected fault at step {step} on rank {self.rank}")


class NullFaults:
    def before_step(self, step: int) -> None:
        pass


def build_faults(cfg, rank: int):
    """A FaultInjector when ``cfg.at_step`` is set and this rank is one of ``cfg.ranks`` (or they are empty)."""
    if cfg.at_step and (not cfg.ranks or rank in cfg.ranks):
        return FaultInjector(cfg.at_step, cfg.kind, rank)
    return NullFaults()
