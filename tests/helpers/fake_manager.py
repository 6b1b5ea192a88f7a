"""torchft's parts faked for the replica layer (freescale/ft/replica.py ``ReplicaLayer``), in one
process, as torchft's own ``manager_test.py`` mocks its client and process group; and
``make_layer``, which builds a layer around them through its own constructor.

- ``FakeManager``: torchft's ``Manager`` for one rank, its quorums scripted.
- torchft's process group, two ways: ``FakeProcessGroup`` sums the other groups' *scripted*
  contributions into this group's (or fails), for one layer alone; ``ThreadedGroups`` is the
  process group of several groups' layers run in one process, a thread each, every collective
  the sum of what each layer put in, so the layers' own code decides every group's part.
- ``FakeTables``: the table side, recording what the layer asks of it.

A step's script is a ``Quorum``: whether this group takes part (or catches up from a peer,
whose state and step it then gets), how many groups take part, what the other groups put into
each cross-replica collective (``Peer``, read by ``FakeProcessGroup`` only), which collective
fails, what the other ranks of the group vote and what is reported as an error during the
quorum. The manager counts steps as torchft's does: ``should_commit`` advances the step when
the vote passes; a group that catches up gets the peer's step at ``wait_quorum`` and its state
at ``should_commit``.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.distributed as dist

from freescale.ft.row_exchange import RowSpace, pack_header, pack_keys, read_header

LR = 0.1
"""The learning rate of the dense SGD optimizer in the states ``training_state`` builds."""


@dataclass
class Peer:
    """Another replica group's part of the step: ``cursor_after`` its data cursor once the step
    commits (None: it catches up, no batch), its row ``keys``, the value it puts in every
    element of the dense gradients and of the rows' values, and whether it vetoes the step."""

    replica: int
    cursor_after: int | None = None
    keys: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    dense: float = 0.0
    rows: float = 0.0
    veto: bool = False
    """It vetoes the step (a group that joins by loading the job's newest checkpoint)."""


@dataclass
class Quorum:
    """One step's quorum as this rank's manager sees it."""

    participating: bool = True
    """False: the group is behind and catches up from a peer in this step."""
    participants: int = 1
    """Groups that take part in the step (torchft's ``num_participants``)."""
    peers: list[Peer] = field(default_factory=list)
    """What the other groups put into the step's collectives (``FakeProcessGroup``)."""
    peer_step: int = 0
    """A group catching up: the peer's committed steps (torchft's ``max_step``)."""
    peer_state: dict | None = None
    """A group catching up: the peer's registered state, given to the layer at the vote (None:
    the fetch failed); a live peer's is its manager's ``registered_state()``."""
    fail_call: int | None = None
    """The cross-replica collective of the step (0: the first) that fails."""
    others_vote: bool = True
    """What the group's other ranks vote."""
    error: Exception | None = None
    """Reported during the quorum (a failed fetch, a peer's error)."""
    step_moved: bool = True
    """A group catching up: torchft moved the manager's step to the peer's (False: the fetch
    failed before it did, as when the transfer itself fails)."""


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
        return _Work(lambda: self._sum(tensor, index))

    def _sum(self, tensor: torch.Tensor, index: int) -> None:
        if index == self.quorum.fail_call:
            raise RuntimeError(f"a peer died in collective {index}")
        peers = self.quorum.peers
        if index == 0:  # the header
            for p in peers:
                tensor += pack_header(self.replicas, p.replica, p.cursor_after, len(p.keys), veto=p.veto)
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
    """An issued collective; ``wait`` completes it."""

    def __init__(self, complete=lambda: None) -> None:
        self._complete = complete

    def wait(self):
        self._complete()
        return True


class ThreadedGroups:
    """torchft's process group between ``groups`` replica groups whose layers run in this
    process, a thread each (``in_threads``): ``member(g)`` is group ``g``'s end. An all-reduce
    waits until every group's thread has put its tensor in, then writes their sum (in group
    order) into each; so every layer must issue the same collectives, as real peers must.
    Nothing is scripted (a quorum's ``peers`` are ignored): what each group contributes is its
    own layer's to decide. An abort breaks the meeting, releasing the threads waiting in it."""

    def __init__(self, groups: int) -> None:
        self._barrier = threading.Barrier(groups, timeout=60)
        self._parts: dict[int, torch.Tensor] = {}
        self.sent: dict[int, list[torch.Tensor]] = {g: [] for g in range(groups)}
        """Every tensor each group put into an all-reduce, as it put it in."""

    def member(self, group: int) -> _Member:
        return _Member(self, group)

    def _allreduce(self, group: int, tensor: torch.Tensor) -> None:
        self._parts[group] = tensor.clone()
        self.sent[group].append(self._parts[group])
        self._barrier.wait()  # every group's part is in
        total = self._parts[0].clone()
        for g in range(1, len(self._parts)):
            total += self._parts[g]
        self._barrier.wait()  # every group has read the parts before the next collective
        tensor.copy_(total)


class _Member:
    """One group's end of ``ThreadedGroups``: torchft's process group as the layer uses it."""

    def __init__(self, groups: ThreadedGroups, group: int) -> None:
        self.groups, self.group = groups, group
        self.aborted = 0

    def new_step(self, quorum: Quorum) -> None:
        pass  # the peers are live layers: nothing to script

    def allreduce(self, tensors, opts):
        (tensor,) = tensors
        self.groups._allreduce(self.group, tensor)
        return _Work()

    def abort(self) -> None:
        self.aborted += 1
        self.groups._barrier.abort()


def in_threads(jobs: list) -> list:
    """Run every callable in ``jobs`` at once, a thread each; their results, in order (the first
    exception raised, re-raised)."""
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(job) for job in jobs]
        return [f.result() for f in futures]


class FakeManager:
    """torchft's ``Manager`` for one rank, its quorums scripted (``quorums``, one per
    ``start_quorum``; a plain ``Quorum()`` once they run out). Each quorum is handed to the
    process group ``pg`` (``new_step``)."""

    def __init__(self, pg, quorums=()) -> None:
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

    def registered_state(self) -> dict:
        """What torchft sends a group that catches up from this rank: every registered state."""
        return {key: save() for key, save in self.save_fns.items()}

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
        if not self.quorum.participating and self.quorum.step_moved:
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
    """The layer's table side over ``space`` (default: one block of 8 rows, 2 wide), recording
    what it is asked: the rows touched, the sums applied, rollbacks and commits, and the state a
    peer hands over."""

    def __init__(self, space: RowSpace | None = None) -> None:
        self.space = space if space is not None else RowSpace((8,), (2,))
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


def group_of_ranks(rank: int = 0, size: int = 1, store=None):
    """The process group of a replica group's own ranks (the vote's check runs there): gloo over
    an in-process store (``store`` shared by the ``size`` ranks' threads)."""
    return dist.ProcessGroupGloo(dist.PrefixStore("group", store or dist.HashStore()), rank, size)


def training_state(replicas: int, replica: int, *, step: int = 0, next_batch: int = 0, fill: float | None = None):
    """A group's training state as the trainer holds it, and its model and optimizer: a small
    dense model (the same initial weights in every group, drawn without touching the caller's
    random stream; or every parameter ``fill``), SGD at ``LR``, the trainer's ``step``, and a
    data cursor that holds every group at batch ``next_batch``."""
    from freescale.config import TrainConfig
    from freescale.model.sharding import build_dense_optimizer
    from freescale.train.state import DataCursor, RNGState, TrainerState, TrainingState

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
    if fill is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(fill)
    optimizer = build_dense_optimizer(model, TrainConfig(optimizer="sgd", lr=LR))
    loader = SimpleNamespace(shard=replica, next_batch=next_batch, position_after=lambda b: b + 1)
    trainer = TrainerState()
    trainer.step = step
    data = DataCursor(loader, groups=replicas)
    data.positions = [next_batch] * replicas
    state = TrainingState(model=model, optimizer=optimizer, trainer=trainer, data=data, rng=RNGState(0))
    return state, model, optimizer


def make_layer(quorums=(), *, replicas: int = 2, replica: int = 0, step: int = 0, next_batch: int = 0, pg=None,
               side=None, group=None, rank: int = 0, run_dir=os.devnull, **ft) -> SimpleNamespace:
    """A ``ReplicaLayer`` of group ``replica`` of ``replicas``, built by its own constructor
    around the fakes: a ``FakeManager`` scripted with ``quorums``; ``pg`` torchft's process group
    (default: a ``FakeProcessGroup`` of the scripted peers; a ``ThreadedGroups`` member to meet
    other layers); ``side`` the table side (default: ``FakeTables``); the state of
    ``training_state`` at ``step`` and ``next_batch``; ``group`` the process group of the
    group's ranks and ``rank`` this one's in it (default: a group of one rank); ``run_dir``
    where it writes its progress (the default refuses a write: a test that commits passes a
    folder); ``ft`` other ``FTConfig`` fields. Returns the parts: layer, manager, pg, tables,
    model, state."""
    from freescale.config import ExperimentConfig, FTConfig
    from freescale.ft.files import ReplicaFiles
    from freescale.ft.replica import ReplicaLayer

    state, model, optimizer = training_state(replicas, replica, step=step, next_batch=next_batch)
    pg = pg if pg is not None else FakeProcessGroup(replicas)
    manager = FakeManager(pg, quorums)  # no manager server, no lighthouse
    side = side if side is not None else FakeTables()
    cfg = ExperimentConfig(ft=FTConfig(enable=True, num_replicas=replicas, replica_id=replica, **ft))
    topo = SimpleNamespace(rank=rank, pg=group if group is not None else group_of_ranks())
    layer = ReplicaLayer(cfg, topo, state, list(model.parameters()), optimizer, side, ReplicaFiles(str(run_dir)),
                         manager=manager, pg=pg)
    return SimpleNamespace(layer=layer, manager=manager, pg=pg, tables=side, model=model, state=state)
