"""torchft's parts faked for the replica layer's step, in one process (as torchft's own
``manager_test.py`` mocks its client and process group): a ``FakeManager`` whose quorums are
scripted, a ``FakeProcessGroup`` that sums the other groups' scripted contributions into
this group's or fails, and a ``FakeTables`` side that records what the layer asks of it.

A step's script is a ``Quorum``: whether this group takes part (or catches up from a peer,
whose state and step it then gets), how many groups take part, what the other groups put into
each cross-replica collective (``Peer``), which collective fails, what the other ranks of the
group vote and what is reported as an error during the quorum. The manager counts steps as
torchft's does: ``should_commit`` advances the step when the vote passes; a group that catches
up gets the peer's step at ``wait_quorum`` and its state at ``should_commit``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from freescale.ft.row_exchange import RowSpace, pack_header, pack_keys, read_header


@dataclass
class Peer:
    """Another replica group's part of the step: ``cursor_after`` its data cursor once the step
    commits (None: it catches up, no batch), its row ``keys``, and the value it puts in every
    element of the dense gradients and of the rows' values."""

    replica: int
    cursor_after: int | None = None
    keys: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    dense: float = 0.0
    rows: float = 0.0


@dataclass
class Quorum:
    """One step's quorum as this rank's manager sees it."""

    participating: bool = True
    """False: the group is behind and catches up from a peer in this step."""
    participants: int = 1
    """Groups that take part in the step (torchft's ``num_participants``)."""
    peers: list[Peer] = field(default_factory=list)
    peer_step: int = 0
    """A group catching up: the peer's committed steps (torchft's ``max_step``)."""
    peer_state: dict | None = None
    """A group catching up: the peer's registered state, given to the layer at the vote (None: the fetch failed)."""
    fail_call: int | None = None
    """The cross-replica collective of the step (0: the first) that fails."""
    others_vote: bool = True
    """What the group's other ranks vote."""
    error: Exception | None = None
    """Reported during the quorum (a failed fetch, a peer's error)."""


class FakeProcessGroup:
    """torchft's process group: ``allreduce`` sums the scripted peers' parts into the tensor
    (header, keys, dense gradients, row values: the layer's order) or, at the step's
    ``fail_call``, fails at ``wait``; ``abort`` is recorded."""

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self.quorum = Quorum()
        self.calls: list[torch.Tensor] = []  # this step's tensors as this group sent them
        self.aborted = 0
        self._header = None

    def new_step(self, quorum: Quorum) -> None:
        self.quorum, self.calls, self._header = quorum, [], None

    def allreduce(self, tensors, opts):
        (tensor,) = tensors
        index = len(self.calls)
        self.calls.append(tensor.clone())
        return _Work(self, tensor, index)

    def _sum(self, tensor: torch.Tensor, index: int) -> None:
        if index == self.quorum.fail_call:
            raise RuntimeError(f"a peer died in collective {index}")
        peers = self.quorum.peers
        if index == 0:  # the header
            for p in peers:
                tensor += pack_header(self.replicas, p.replica, p.cursor_after, len(p.keys))
            self._header = read_header(tensor.clone(), self.replicas)
        elif tensor.dtype == torch.int64:  # the keys, each group's in its segment
            for p in peers:
                if p.cursor_after is not None:
                    tensor += pack_keys(p.keys, self._header.counts, p.replica)
        else:  # dense gradients first, then the rows' values
            floats = sum(1 for t in self.calls[:index] if t.dtype != torch.int64)
            for p in peers:
                tensor += p.dense if floats == 0 else p.rows

    def abort(self) -> None:
        self.aborted += 1


class _Work:
    def __init__(self, pg: FakeProcessGroup, tensor: torch.Tensor, index: int) -> None:
        self.pg, self.tensor, self.index = pg, tensor, index

    def wait(self):
        self.pg._sum(self.tensor, self.index)
        return True


class FakeManager:
    """torchft's ``Manager`` for one rank, its quorums scripted (``quorums``, one per
    ``start_quorum``; a plain ``Quorum()`` once they run out)."""

    def __init__(self, pg: FakeProcessGroup, quorums=()) -> None:
        self.pg = pg
        self.quorums = deque(quorums)
        self.quorum = Quorum()
        self.load_fns: dict = {}
        self.save_fns: dict = {}
        self.calls: list[str] = []
        self.votes: list[bool] = []
        self.shut_down = False
        self._step = 0
        self._batches = 0
        self._errored: Exception | None = None
        self._waited = False

    def register_state_dict_fn(self, key, load_state_dict, state_dict) -> None:
        assert key not in self.load_fns
        self.load_fns[key], self.save_fns[key] = load_state_dict, state_dict

    def start_quorum(self, *args, **kwargs) -> None:
        self.calls.append("start_quorum")
        self.quorum = self.quorums.popleft() if self.quorums else Quorum()
        self.pg.new_step(self.quorum)
        self._errored, self._waited = None, False

    def wait_quorum(self) -> None:
        if self._waited:
            return
        self._waited = True
        self.calls.append("wait_quorum")
        if not self.quorum.participating:
            self._step = self.quorum.peer_step  # (torchft loads the peer's step with its state)
        if self.quorum.error is not None:
            self.report_error(self.quorum.error)

    def should_commit(self, timeout=None) -> bool:
        self.wait_quorum()
        if not self.quorum.participating and self._errored is None:
            if self.quorum.peer_state is None:
                self.report_error(RuntimeError("fetching the peer's state failed"))
            else:
                for key, load in self.load_fns.items():
                    load(self.quorum.peer_state[key])
        ok = self._errored is None and self.quorum.others_vote
        self.votes.append(ok)
        if ok:
            self._step += 1
            self._batches += self.quorum.participants
        return ok

    def report_error(self, e: Exception) -> None:
        self._errored = e

    def errored(self):
        return self._errored

    def current_step(self) -> int:
        return self._step

    def batches_committed(self) -> int:
        return self._batches

    def load_state_dict(self, state: dict) -> None:
        self._step, self._batches = state["step"], state["batches_committed"]

    def is_participating(self) -> bool:
        self.wait_quorum()
        return self.quorum.participating

    def num_participants(self) -> int:
        self.wait_quorum()
        return self.quorum.participants

    def shutdown(self, wait: bool = True) -> None:
        self.shut_down = True


class FakeTables:
    """The layer's table side, recording what it is asked: the rows touched, the sums applied,
    rollbacks and commits, and the state a peer hands over."""

    def __init__(self, rows: int = 8, width: int = 2) -> None:
        self.space = RowSpace((rows,), (width,))
        self.applied: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.events: list[str] = []
        self.loaded: list[dict] = []

    def touch(self, touched) -> None:
        self.events.append("touch")

    def apply(self, plan, summed: torch.Tensor) -> None:
        self.events.append("apply")
        self.applied.append((plan.keys.clone(), summed.clone()))

    def committed(self) -> None:
        self.events.append("committed")

    def rollback(self) -> None:
        self.events.append("rollback")

    def state_dict(self) -> dict:
        return {"side": "tables"}

    def load_state_dict(self, state: dict) -> None:
        self.events.append("load")
        self.loaded.append(state)
