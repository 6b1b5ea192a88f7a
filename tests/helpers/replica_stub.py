"""Replica groups' layers in one process, a thread each: ``ReplicaLayer`` objects with torchft's
manager faked (a group takes part in the step or catches up in it, every vote commits unless an
error was reported) and torchft's process group replaced by a sum across the threads, so the
layer's own code decides what each group puts into the cross-group collectives."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import torch


class FakeManager:
    """What the layer asks of torchft's ``Manager`` in a step, answered from fixed facts: the
    step's quorum is ``participants`` groups (this one among them, or catching up), torchft's
    step is ``step``; ``should_commit`` is false once an error was reported, as torchft's is."""

    def __init__(self, participating: bool, participants: int, step: int = 0) -> None:
        self.participating = participating
        self.participants = participants
        self.step = step
        self.errors: list[Exception] = []
        self.loaded: list[dict] = []

    def start_quorum(self) -> None:
        pass

    def wait_quorum(self) -> None:
        pass

    def current_step(self) -> int:
        return self.step

    def is_participating(self) -> bool:
        return self.participating

    def num_participants(self) -> int:
        return self.participants

    def report_error(self, e: Exception) -> None:
        self.errors.append(e)

    def errored(self) -> Exception | None:
        return self.errors[-1] if self.errors else None

    def should_commit(self) -> bool:
        return not self.errors

    def load_state_dict(self, state: dict) -> None:
        self.loaded.append(state)

    def batches_committed(self) -> int:
        return 0


class _Done:
    def wait(self) -> None:
        pass


class SumAcrossThreads:
    """torchft's process group between ``groups`` threads: an all-reduce is the sum of what each
    group's thread put in, in group order, written back into every group's tensor."""

    def __init__(self, groups: int) -> None:
        self._barrier = threading.Barrier(groups, timeout=60)
        self._parts: dict[int, torch.Tensor] = {}
        self.sent: dict[int, list[torch.Tensor]] = {g: [] for g in range(groups)}
        """Every tensor each group put into an all-reduce, as it put it in."""

    def member(self, group: int):
        hub = self

        class Member:
            def allreduce(self, tensors, opts):
                (t,) = tensors
                hub._parts[group] = t.clone()
                hub.sent[group].append(hub._parts[group])
                hub._barrier.wait()  # every group's part is in
                total = hub._parts[0].clone()
                for g in range(1, len(hub._parts)):
                    total += hub._parts[g]
                hub._barrier.wait()  # every group has read the parts before the next collective
                t.copy_(total)
                return _Done()

            def abort(self) -> None:
                pass

        return Member()


class SideStub:
    """The table side: a row space, and the summed rows each applied step handed it."""

    def __init__(self, space) -> None:
        self.space = space
        self.applied: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.rolled_back = 0
        self.commits = 0

    def touch(self, touched) -> None:
        pass

    def apply(self, plan, values: torch.Tensor) -> None:
        self.applied.append((plan.keys.clone(), values.clone()))

    def rollback(self) -> None:
        self.rolled_back += 1

    def committed(self) -> None:
        self.commits += 1


def stub_layer(*, replica: int, replicas: int, manager: FakeManager, pg, side, params: list = (), optimizer=None,
               group=None, trainer_step: int = 0, next_batch: int = 0):
    """A ``ReplicaLayer`` of group ``replica`` built around fakes: no manager server, no
    lighthouse (``group``: the process group of the group's own ranks, which the vote's check
    of the group uses; ``optimizer`` None: a layer that only exchanges, and never votes)."""
    from freescale.config import FTConfig
    from freescale.ft.replica import ReplicaLayer

    layer = ReplicaLayer.__new__(ReplicaLayer)
    layer.cfg = FTConfig(enable=True, num_replicas=replicas, replica_id=replica)
    layer.replicas, layer.replica, layer.rank, layer.group = replicas, replica, 0, group
    layer.manager, layer.pg, layer.side = manager, pg, side
    layer.dense_params, layer.optimizer = list(params), optimizer
    layer.base_lrs = [g["lr"] for g in optimizer.param_groups] if optimizer is not None else []
    layer.state = SimpleNamespace(parts={"trainer": SimpleNamespace(step=trainer_step),
                                         "data": SimpleNamespace(next_batch=next_batch, positions=[0] * replicas)})
    layer._step, layer._quorum_open, layer._failed, layer._copy_engine = trainer_step + 1, False, False, None
    layer._header, layer._stash, layer._joining, layer.on_contribute = None, None, False, None
    return layer


def in_threads(jobs: list) -> list:
    """Run every callable in ``jobs`` at once, a thread each; their results, in order (the first
    exception raised, re-raised)."""
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(job) for job in jobs]
        return [f.result() for f in futures]
