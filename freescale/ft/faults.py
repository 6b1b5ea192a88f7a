"""Faults inside torchft's parts: wrappers around the process group, the checkpoint transport
and the manager strike where ``fault.*`` declares (``freescale.faults`` says when and how),
so the replica layer itself has no fault branch (the shape of torchft's own
``FakeProcessGroupWrapper``).

- ``FaultyProcessGroup``: the step's cross-replica all-reduces (``fault.during: allreduce``);
- ``FaultyTransport``: fetching a live peer's state (``fault.during: recover``);
- ``FaultyManager``: the step's quorum (``fault.during: quorum``), its vote
  (``fault.during: vote``), holds (``fault.kind: hold``: the group votes against the step until
  every group is in it, waiting ``HOLD_RETRY_S`` before each vote against so that it trains the
  step again at a calm pace) and declared commit failures (``fault.fail_commit_at``: the group
  votes against those steps once each).

``wrap_*`` return the part itself when nothing is declared there.
"""

from __future__ import annotations

import time
from typing import Callable

from torchft.checkpointing.transport import CheckpointTransport
from torchft.process_group import ProcessGroupWrapper

from freescale.faults import InjectedFault, NullFaults


class FaultyProcessGroup(ProcessGroupWrapper):
    """torchft's process group, with the declared fault at the step's all-reduces."""

    def __init__(self, pg, faults, step: Callable[[], int]) -> None:
        super().__init__(pg=pg)
        self.faults = faults
        self.step = step

    def allreduce(self, tensors, opts):
        self.faults.at("allreduce", self.step())
        return super().allreduce(tensors, opts)

    def abort(self, errored: bool = True) -> None:
        self.parent.abort()  # the wrapped group aborts; this wrapper keeps wrapping it

    def getBackendName(self) -> str:
        return self.parent.getBackendName()


class FaultyTransport(CheckpointTransport):
    """torchft's checkpoint transport, with the declared fault as a peer's state is fetched."""

    def __init__(self, transport: CheckpointTransport, faults) -> None:
        self.transport = transport
        self.faults = faults

    def metadata(self) -> str:
        return self.transport.metadata()

    def send_checkpoint(self, dst_ranks, step, state_dict, timeout) -> None:
        self.transport.send_checkpoint(dst_ranks, step, state_dict, timeout)

    def disallow_checkpoint(self) -> None:
        self.transport.disallow_checkpoint()

    def recv_checkpoint(self, src_rank, metadata, step, timeout):
        self.faults.at("recover", step + 1)  # ``step``: the peer's committed steps; the catch-up is in the next
        return self.transport.recv_checkpoint(src_rank, metadata, step, timeout)

    def shutdown(self, wait: bool = True) -> None:
        self.transport.shutdown(wait)


# A held group's pause before each vote against: the quorum a returning group joins is at most
# this far off, and the held group does not spin through its step meanwhile.
HOLD_RETRY_S = 0.1


class FaultyManager:
    """torchft's manager, with the declared faults at the quorum or the vote, holds and the
    declared commit failures. ``groups_in_step``: the replica groups in the step being voted on
    (a group catching up counts), of ``groups``."""

    def __init__(self, manager, faults, groups_in_step: Callable[[], int], groups: int) -> None:
        self.manager = manager
        self.faults = faults
        self.fail_commit_at = set(faults.fail_commit_at)
        self.groups_in_step = groups_in_step
        self.groups = groups

    def start_quorum(self, *args, **kwargs) -> None:
        self.faults.at("quorum", self.manager.current_step() + 1)
        self.manager.start_quorum(*args, **kwargs)

    def should_commit(self, *args, **kwargs) -> bool:
        step = self.manager.current_step() + 1
        self.faults.at("vote", step)
        held = self.faults.hold(step, self.groups_in_step(), self.groups)
        if held:
            time.sleep(HOLD_RETRY_S)
            self.manager.report_error(InjectedFault(held))
        elif step in self.fail_commit_at:
            self.fail_commit_at.discard(step)  # the step trained again commits
            self.manager.report_error(InjectedFault(f"injected commit failure at step {step}"))
        return self.manager.should_commit(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.manager, name)


def wrap_process_group(pg, faults, step: Callable[[], int]):
    return pg if isinstance(faults, NullFaults) else FaultyProcessGroup(pg, faults, step)


def wrap_transport(transport, faults):
    return transport if isinstance(faults, NullFaults) else FaultyTransport(transport, faults)


def wrap_manager(manager, faults, groups_in_step: Callable[[], int], groups: int):
    return manager if isinstance(faults, NullFaults) else FaultyManager(manager, faults, groups_in_step, groups)
