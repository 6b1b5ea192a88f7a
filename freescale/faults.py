"""Declared faults: a rank fails at a chosen step, so recovery and clean-up can be tested.

``fault.at_step: N`` with ``fault.ranks`` (ranks within the replica; empty: every rank) and
``fault.kind``:

- ``raise``: an exception, as a bug or a failed transfer would raise;
- ``exit``: the process ends at once (``os._exit``) as a crash or a kill would: nothing is
  closed or written after it, which is what checkpoints and the ledger must survive;
- ``delay``: the rank stalls for ``fault.delay_s`` seconds there, as a slow or paused host would.

``fault.during`` says where in step N: ``step`` (as it begins: the trainer asks), or, under
the replica layer, inside torchft's parts, where wrappers around them strike
(``freescale.ft.faults``): ``quorum`` (the step's quorum), ``allreduce`` (the step's first
cross-replica all-reduce), ``vote`` (after every collective of the step, as the group's
vote is cast: a group that dies there leaves a step its peers commit with its batch in) or
``recover`` (fetching a live peer's state, at the first catch-up at or after step N). Under
the replica layer ``fault.replicas`` picks the groups (empty: every one), and a fault strikes
once per run folder (a marker file under ``faults/``): the group, restarted with the same
config, goes on.

Off (``at_step: 0``, the default) the trainer holds a ``NullFaults`` that does nothing.
"""

from __future__ import annotations

import os
import sys
import time


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

    def before_step(self, step: int) -> None:
        """``step``: the number the step will have once done (1-based)."""
        self.at("step", step)

    def at(self, point: str, step: int) -> None:
        """Strike if the fault is declared at ``point`` of step ``step``."""
        if point != self.during or (step < self.at_step if point == "recover" else step != self.at_step):
            return
        if self.marker:
            if os.path.exists(self.marker):
                return
            os.makedirs(os.path.dirname(self.marker), exist_ok=True)
            open(self.marker, "w").close()
        where = "" if point == "step" else f" during {point}"
        if self.kind == "delay":
            print(f"[fault] rank {self.rank} stalls {self.delay_s:g} s at step {step}{where}", file=sys.stderr, flush=True)
            time.sleep(self.delay_s)
            return
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
    are empty); under the replica layer (``replica`` given) also one of ``cfg.replicas``, struck
    once per run folder."""
    if not cfg.at_step or (cfg.ranks and rank not in cfg.ranks):
        return NullFaults()
    if replica is None:
        return FaultInjector(cfg.at_step, cfg.kind, rank, cfg.during, delay_s=cfg.delay_s)
    if cfg.replicas and replica not in cfg.replicas:
        return NullFaults()
    marker = os.path.join(run_dir, "faults", f"rank{rank}-{cfg.during}-step{cfg.at_step}")
    return FaultInjector(cfg.at_step, cfg.kind, rank, cfg.during, marker, cfg.delay_s)
