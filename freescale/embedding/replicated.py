"""FreeScale's own tables across replica groups: one synchronous job, whatever the groups.

The owner of a shard holds the step's row gradients before it applies them (the fused
optimizer runs when the pipeline calls it, not inside backward), so under the replica layer
the owners of the same shard in every group sum them first: each contributes its rows'
gradients (summed over their repeats, ``row_gradients``), the layer sums them over the union of
the groups' rows (``freescale.ft.row_exchange``) and, once the step is voted in, every group
applies the same sums with the same fused update (``OwnedRows.apply``). R groups then train
like one synchronous job with R times the batch, up to the order of the float additions, and
every group's tables stay equal, bit for bit, at every step: there is nothing to average, and
nothing is written before the vote, so a failed vote has nothing to roll back. A group that
catches up contributes zeros and applies the same sums to the peer's tables it loads.

The pipelines under the layer are the plain schedules of ``freescale.embedding.pipeline`` with
their hooks overridden (as TorchRec's pipeline variants override ``TrainPipelineSparseDist``'s):

- ``ReplicatedSyncPipeline``: the step starts the layer's quorum; after the gradient exchange
  the rows this group wrote are exchanged with the other groups (``exchange_rows``), then the
  vote (``finish``); a batch whose step did not commit is drawn again.
- ``ReplicatedPrioritizedPipeline``: the rows every group's batch i writes are exchanged
  between forward and backward, so batch i+1's collision rows are those *any* group's batch i
  writes (its early rows are then final whatever the other groups do); the split and the flags
  wait for it. Batch i's gradients all reach their owners (collision rows first) and batch
  i+1's exclusive rows arrive before the vote, so nothing is deferred and a step trained
  again leaves no exchange of its own in flight; batch i+1's collision rows are sent once the
  update is in. After a catch-up (the vote took a peer's state) rows read before the vote are
  read anew.

The lookups are untracked (``tracked = False``): the rows' update is the groups' sums, applied
by ``OwnedRows.apply``.
"""

from __future__ import annotations

from typing import Iterator

import torch

from freescale.data.batch import Batch
from freescale.embedding.exchange import ShardedTables
from freescale.embedding.pipeline import (DenseReduction, PrioritizedEmbeddingPipeline, SyncEmbeddingPipeline,
                                          _Staged, _Step)
from freescale.ft.row_exchange import RowPlan, RowSpace, local_sums


class OwnedRows:
    """The replica layer's table side for ``ShardedTables``."""

    def __init__(self, tables: ShardedTables) -> None:
        self.tables = tables
        self.space = RowSpace((int(tables.weight.shape[0]),), (tables.dim,))

    def apply(self, plan: RowPlan, summed: torch.Tensor) -> None:
        if plan.keys.numel():
            device = self.tables.device  # the plan and the sums are on the host (the replica layer's)
            self.tables.update(plan.rows(0).to(device), plan.values(summed, 0).to(device))

    def touch(self, touched) -> None:
        """(Nothing is written before the vote.)"""

    def committed(self) -> None:
        pass

    def rollback(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def row_gradients(plan: RowPlan, ids: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """This group's part of the step's row gradients in ``plan``'s layout: ``grads`` (one row
    per id of ``ids``, as the owner received them) summed per row."""
    out = torch.zeros(plan.size)
    if plan.size:
        rows, sums = local_sums(ids, grads)
        kept = torch.isin(rows, plan.rows(0))  # all of them, unless this group's rows were left out (it catches up)
        plan.scatter(0, rows[kept], sums[kept], out)
    return out


class _Voted:
    """What both replicated pipelines add to their schedule: the replica layer (``replica``),
    the quorum started with each step, and the commit."""

    tracked = False

    def __init__(self, *args, replica, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Each step is voted on; a batch whose step did not commit (or that a group catching
        # up did not train) is trained again.
        self.replica = replica

    def _begin_step(self) -> None:
        self.replica.begin()

    def _commit(self, plan: RowPlan, ids: torch.Tensor, got: torch.Tensor, dense: DenseReduction) -> bool:
        """The dense gradients averaged over the group, then the rest of the step across the
        groups (``ReplicaLayer.finish``: the row gradients ``got`` of the owned ``ids`` summed
        over ``plan``, the vote, the update). Whether this group's batch is in the model (if
        not, it is trained again)."""
        with self.timeline.span("optimizer"):
            dense.wait()
        with self.timeline.span("vote"):
            self.vote = self.replica.finish(plan, row_gradients(plan, ids, got.cpu()))
        return self.vote.trained


class ReplicatedSyncPipeline(_Voted, SyncEmbeddingPipeline):
    """``sync`` under the replica layer (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._replay: Batch | None = None  # a batch whose step did not commit
        self._in_hand: Batch | None = None

    def _draw(self, batches: Iterator) -> Batch:
        self._in_hand, self._replay = (self._replay or next(batches)), None
        return self._in_hand

    def _end_step(self, staged: _Staged, got: torch.Tensor, dense: DenseReduction) -> None:
        ids = staged.route.ids
        plan = self.replica.exchange_rows(torch.unique(ids), self._in_hand)
        if not self._commit(plan, ids, got, dense):
            self._replay = self._in_hand


class ReplicatedPrioritizedPipeline(_Voted, PrioritizedEmbeddingPipeline):
    """``prioritized`` under the replica layer (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._replay_after: _Staged | None = None  # the batch after next, already staged, of a step trained again
        self._replaying = False

    def _stage_after(self, batches: Iterator) -> _Staged | None:
        """A step trained again keeps the batch after next it staged."""
        if self._replaying:
            self._replaying = False
            after, self._replay_after = self._replay_after, None
            return after
        return super()._stage_after(batches)

    def _before_forward(self, step: _Step) -> None:
        """(What batch i writes is known only once the groups have said what theirs write.)"""

    def _between_forward_and_backward(self, step: _Step) -> None:
        """The rows every group's batch i writes, then batch i+1's split by them."""
        step.plan = self.replica.exchange_rows(torch.unique(step.cur.route.ids), step.cur.batch)
        if step.nxt is not None:
            step.flags = self._split(step.cur, step.nxt, step.plan.rows(0))
        super()._between_forward_and_backward(step)

    def _finish(self, step: _Step, sent: torch.Tensor, dense: DenseReduction) -> None:
        """Every gradient of batch i at its owner (collision rows first) and batch i+1's
        exclusive rows in, then the vote; then batch i+1's collision rows. Nothing was written
        before the vote; after a catch-up the tables are a peer's, so rows read before it are
        read anew."""
        cur, nxt = step.cur, step.nxt
        collision = self._send_collision_gradients(cur, sent)
        deferred = self._send_deferred(cur, sent)
        with self.timeline.span("collision_wait"):
            hot_got = collision.wait()
        got = self._all_gradients(cur, hot_got, deferred)
        with self.timeline.span("exclusive_wait"):
            nxt.exclusive = self._wait(nxt.exclusive)
        if not self._commit(step.plan, cur.route.ids, got, dense):  # the same batch again
            if self.vote.rewritten:
                cur.rows = self._lookup_all(cur)
            self._replay_after, self._replaying = step.after, True
            return
        if self.vote.rewritten:
            nxt.rows = self._lookup_all(nxt)
        else:
            self._send_collision_rows(nxt)
        self._advance(step)

    def _finish_last(self, step: _Step, got: torch.Tensor, dense: DenseReduction) -> None:
        """The last batch of the data: the vote, nothing read ahead."""
        if self._commit(step.plan, step.cur.route.ids, got, dense):
            self._advance(step)
        elif self.vote.rewritten:
            step.cur.rows = self._lookup_all(step.cur)


PIPELINES = {"sync": ReplicatedSyncPipeline, "prioritized": ReplicatedPrioritizedPipeline}
"""The pipelines over FreeScale's own tables under the replica layer, by ``train.pipeline``."""
