"""Training pipelines: one interface, ``TrainPipeline``, and one class per ``train.pipeline``.

- ``sparse_dist`` (``SparseDistPipeline``): TorchRec's ``TrainPipelineSparseDist``, the
  baseline. It starts batch i+1's input distribution (the id all-to-all) while batch i
  computes, then blocks on the embedding all-to-alls inside forward and backward.
- ``base`` (``BasePipeline``): TorchRec's ``TrainPipelineBase``: no overlap, the synchronous
  reference.
- ``pec`` (``PECPipeline``): TorchRec's PEC modules on the item table, driven by
  ``freescale.train.pec.PECSparseDist`` (TorchRec 1.8.0 has no PEC pipeline), the gradients
  applied as the standard path applies them (``compat.apply_pec_gradient``).
- ``sync`` and ``prioritized`` (``SyncPipeline``, ``PrioritizedPipeline``): FreeScale's own
  row-wise sharded tables, the embedding exchanges synchronous or ordered by priority
  (``freescale.embedding.pipeline``), over a transport of their own.

Under the replica layer (``ft.enable``) each runs as its replicated variant, a subclass that
overrides the hooks where the layer takes part in a step: ``ReplicaSparseDist``,
``ReplicaPEC``, ``ReplicaSync`` and ``ReplicaPrioritized`` (whose schedules are
``freescale.embedding.replicated``'s); ``base`` has none. No schedule asks whether the layer
is on: the variant is chosen once, at build time (``pipeline_class``).

Each class says which tables its model holds (``table_kind``: ``freescale.train.tables``) and is
built by ``build(model, optimizer, device, timeline, *, group, transport_cfg, replica)``
(``replica``: the layer a replicated variant votes with; the plain ones take none); the
registries ``PIPELINES`` and ``REPLICATED`` map the config's name to the class, looked up once.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from typing import Callable, ContextManager, Iterator, Protocol

import torch
from torchrec.distributed.train_pipeline import TrainPipelineBase

from freescale import compat
from freescale.data.batch import Batch
from freescale.ft.replica import COMMITTED, Vote
from freescale.model.seqrec import StepOutput
from freescale.profile.timeline import instrument_phases
from freescale.train.sparse_dist import ProfiledSparseDist
from freescale.train.tables import OWNED_TABLES, PEC_TABLES, TORCHREC_TABLES

log = logging.getLogger("freescale")


class TrainPipeline(Protocol):
    """What the training loop drives, in the shape of TorchRec's ``TrainPipeline``.

    ``progress(batches)`` trains one batch drawn from ``batches`` (a pipeline may draw ahead)
    and returns its ``StepOutput``. ``vote`` says how that step ended under the replica layer
    (``COMMITTED`` without one): a step not ``stepped`` was rolled back, and the next
    ``progress`` trains its batch again. ``drain()`` applies every update the trained batches
    still owe the tables (before evaluation, a checkpoint, the end of the run).
    ``evaluating()`` yields a callable ``model(batch) -> (loss, StepOutput)`` over the current
    weights in eval mode and leaves the batches in flight untouched. ``close()`` releases what
    the pipeline opened.
    """

    def progress(self, batches: Iterator[Batch]) -> StepOutput: ...

    def drain(self) -> None: ...

    def close(self) -> None: ...

    def evaluating(self) -> ContextManager[Callable[[Batch], tuple]]: ...

    @property
    def vote(self) -> Vote: ...


# TorchRec's pipelines --------------------------------------------------------------------------

class _TorchRecPipeline:
    """A TorchRec pipeline (``inner``) plus the DMP model it drives, on ``device``."""

    table_kind = TORCHREC_TABLES

    def __init__(self, inner, model: torch.nn.Module, device: torch.device) -> None:
        self.inner = inner
        self.model = model
        self.device = device

    vote = COMMITTED  # no replica layer here: every step commits

    def progress(self, batches: Iterator[Batch]) -> StepOutput:
        return self.inner.progress(batches)

    def drain(self) -> None:
        """Nothing is deferred past a step in TorchRec's pipelines."""

    def close(self) -> None:
        pass

    @contextlib.contextmanager
    def evaluating(self):
        """The plain model in eval mode, over batches moved to the model's device (the held-out
        batches are read into host memory), after every update the trained batches owe the
        tables (``drain``); training mode is restored after."""
        self.drain()
        with self._plain_forwards():
            self.model.eval()
            try:
                with torch.no_grad():
                    yield lambda batch: self.model(batch.to(self.device))
            finally:
                self.model.train()

    def _plain_forwards(self) -> ContextManager:
        return contextlib.nullcontext()


class SparseDistPipeline(_TorchRecPipeline):
    """``train.pipeline: sparse_dist``: TorchRec's ``TrainPipelineSparseDist``. Evaluation runs
    the plain model: the forwards the pipeline rewrote are swapped back for it
    (``compat.original_forwards``), and the batches in flight are untouched."""

    def __init__(self, model, optimizer, device, timeline) -> None:
        instrument_phases(timeline, model, optimizer)
        super().__init__(self._make_inner(model, optimizer, device, timeline), model, device)

    def _make_inner(self, model, optimizer, device, timeline):
        return ProfiledSparseDist(model, optimizer, device, execute_all_batches=False, timeline=timeline)

    @classmethod
    def build(cls, model, optimizer, device, timeline, *, group=None, transport_cfg=None, replica=None,
              train_cfg=None) -> TrainPipeline:
        return cls(model, optimizer, device, timeline)

    def _plain_forwards(self) -> ContextManager:
        return compat.original_forwards(self.inner)


class PECPipeline(SparseDistPipeline):
    """``train.pipeline: pec``: TorchRec's PEC modules (``freescale.train.pec``). The NOL
    gradients a step defers are applied by ``drain()``; evaluation runs the plain model, as
    under ``sparse_dist``."""

    table_kind = PEC_TABLES

    def __init__(self, model, optimizer, device, timeline, *, corrected: bool = True) -> None:
        self.corrected = corrected
        super().__init__(model, optimizer, device, timeline)

    def _make_inner(self, model, optimizer, device, timeline):
        from freescale.train.pec import PECSparseDist

        return PECSparseDist(model, optimizer, device, timeline=timeline, corrected=self.corrected)

    @classmethod
    def build(cls, model, optimizer, device, timeline, *, group=None, transport_cfg=None, replica=None,
              train_cfg=None) -> TrainPipeline:
        """``train_cfg.pec_corrections``: apply the gradients corrected (the default) or as shipped."""
        return cls(model, optimizer, device, timeline, corrected=train_cfg is None or train_cfg.pec_corrections)

    def drain(self) -> None:
        self.inner.drain()


class BasePipeline(_TorchRecPipeline):
    """``train.pipeline: base``: TorchRec's ``TrainPipelineBase`` (it rewrites no forward)."""

    def __init__(self, model, optimizer, device, timeline) -> None:
        instrument_phases(timeline, model, optimizer)
        super().__init__(TrainPipelineBase(model, optimizer, device), model, device)

    @classmethod
    def build(cls, model, optimizer, device, timeline, *, group=None, transport_cfg=None, replica=None,
              train_cfg=None) -> TrainPipeline:
        return cls(model, optimizer, device, timeline)


class VotedOptimizer:
    """The optimizer TorchRec's pipeline steps, under the replica layer. ``step`` (after
    backward, in which the fused optimizer has already written the tables): the rest of the
    step across the replica groups (``ReplicaLayer.finish``: the dense gradients, already
    averaged over the group by DDP, averaged over the groups; the tables' changes added up
    when a sync is due; the vote; the dense optimizer steps only if the step committed)."""

    def __init__(self, optimizer, replica, in_hand) -> None:
        self.optimizer = optimizer
        self.replica = replica
        self.in_hand = in_hand  # the batch being trained
        self.vote = COMMITTED

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None) -> None:
        replica, tables = self.replica, self.replica.side
        plan = replica.exchange_rows(tables.keys(replica.wait_quorum()), self.in_hand())
        self.vote = replica.finish(plan, tables.values(plan))
        self.optimizer.zero_grad(set_to_none=True)

    def __getattr__(self, name: str):
        return getattr(self.optimizer, name)


class _Drawn:
    """The batches a pipeline draws from ``source``, noted in ``drawn`` (oldest first)."""

    def __init__(self, source: Iterator, drawn: deque) -> None:
        self.source = source
        self.drawn = drawn

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.source)
        self.drawn.append(batch)
        return batch


class ReplicaSparseDist(SparseDistPipeline):
    """TorchRec's sparse-dist pipeline under the replica layer.

    Each step is voted on (``VotedOptimizer``); the rows its lookups read are saved for the
    layer before backward writes them (``FusedTables``). A batch that was not trained (its step
    was rolled back, or a group catching up took the step with a peer's state) is trained
    again alone, with the plain model's forwards, before the pipeline goes on: the batches
    TorchRec holds in flight carry ids only, so the pipeline resumes where it was.
    """

    def __init__(self, model, optimizer, device, timeline, replica) -> None:
        self.tables = replica.side.tables
        self.replica = replica
        self.voted = VotedOptimizer(optimizer, replica, self._in_hand)
        self._drawn: deque = deque()
        self._source: _Drawn | None = None
        self._again = None
        super().__init__(model, self.voted, device, timeline)

    @classmethod
    def build(cls, model, optimizer, device, timeline, *, group=None, transport_cfg=None, replica,
              train_cfg=None) -> TrainPipeline:
        return cls(model, optimizer, device, timeline, replica)

    @property
    def vote(self):
        return self.voted.vote

    def progress(self, batches: Iterator):
        self.replica.begin()
        with self.tables.reporting(self.replica.before_update):
            if self._again is None:
                out = self.inner.progress(self._drawing(batches))
                batch = self._drawn.popleft()
                if int(batch.batch_index) != int(out.batch_index):
                    raise RuntimeError(f"the pipeline trained batch {int(out.batch_index)}, "
                                       f"expected {int(batch.batch_index)}")
            else:
                batch = self._again
                out = self._train_alone(batch)
            self._voted()
        self._again = None if self.vote.trained else batch
        return out

    def _voted(self) -> None:
        """After the step's vote, still reporting the rows lookups read (nothing here: TorchRec's
        pipeline holds only ids ahead)."""

    def _in_hand(self):
        """The batch the step trains: one trained again, or the oldest TorchRec has drawn."""
        return self._again if self._again is not None else self._drawn[0]

    def _drawing(self, batches: Iterator) -> _Drawn:
        if self._source is None or self._source.source is not batches:
            self._source = _Drawn(batches, self._drawn)
        return self._source

    def _train_alone(self, batch):
        with self._plain_forwards():
            self.voted.zero_grad()
            losses, out = self.model(batch.to(self.device))
            torch.sum(losses, dim=0).backward()
            self.voted.step()
        return out

    def close(self) -> None:
        self.tables.close()


class ReplicaPEC(ReplicaSparseDist):
    """``train.pipeline: pec`` under the replica layer: ``ReplicaSparseDist``'s vote, rollback
    and training again alone, over ``freescale.train.pec.ReplicatedPECSparseDist`` (every row
    a step writes is written before its vote). The rows the pipeline looked up ahead for the
    next batch are looked up again when a vote rewrote the tables (a catch-up)."""

    table_kind = PEC_TABLES

    def __init__(self, model, optimizer, device, timeline, replica, *, corrected: bool = True) -> None:
        self.corrected = corrected
        self._rewritten = False  # a vote rewrote the tables since the next batch's rows were read
        super().__init__(model, optimizer, device, timeline, replica)

    @classmethod
    def build(cls, model, optimizer, device, timeline, *, group=None, transport_cfg=None, replica,
              train_cfg=None) -> TrainPipeline:
        """``train_cfg.pec_corrections``: apply the gradients corrected (the default) or as shipped."""
        return cls(model, optimizer, device, timeline, replica,
                   corrected=train_cfg is None or train_cfg.pec_corrections)

    def _make_inner(self, model, optimizer, device, timeline):
        from freescale.train.pec import ReplicatedPECSparseDist

        replica = self.replica
        return ReplicatedPECSparseDist(model, optimizer, device, timeline=timeline, corrected=self.corrected,
                                       may_change=lambda: replica.side.due(replica.wait_quorum()))

    def _voted(self) -> None:
        self._rewritten = self._rewritten or self.vote.rewritten
        if self.vote.trained:
            self.inner.look_ahead(anew=self._rewritten)
            self._rewritten = False


# FreeScale's own tables -------------------------------------------------------------------------

class _OwnedTablesPipeline:
    """A pipeline over FreeScale's own tables (``inner``: ``freescale.embedding.pipeline``'s
    schedule of that name) and the transport it closes (two lanes, over a group of its own made
    like the replica's)."""

    table_kind = OWNED_TABLES
    schedule: str

    @staticmethod
    def _schedules() -> dict[str, type]:
        from freescale.embedding.pipeline import PIPELINES as SCHEDULES

        return SCHEDULES

    @classmethod
    def _schedule(cls, model, optimizer, transport, group, timeline, replica):
        return cls._schedules()[cls.schedule](model, optimizer, transport, group, timeline)

    def __init__(self, inner, transport) -> None:
        self.inner = inner
        self.transport = transport

    @classmethod
    def build(cls, model, optimizer, device, timeline, *, group, transport_cfg, replica=None,
              train_cfg=None) -> TrainPipeline:
        from freescale.transport.registry import build_transport, group_for, lanes_for

        lanes, why = lanes_for(transport_cfg.lanes, group, transport_cfg.kind)
        log.info(f"{cls.schedule}: transport {transport_cfg.kind}, {lanes} lane{'s' if lanes > 1 else ''} ({why})")
        transport = build_transport(transport_cfg, group_for(transport_cfg.kind, group), lanes=lanes)
        return cls(cls._schedule(model, optimizer, transport, group, timeline, replica), transport)

    def progress(self, batches: Iterator[Batch]) -> StepOutput:
        return self.inner.progress(batches)

    def drain(self) -> None:
        self.inner.drain()

    def evaluating(self):
        return self.inner.evaluating()

    @property
    def vote(self) -> Vote:
        return self.inner.vote

    def close(self) -> None:
        self.transport.close()


class SyncPipeline(_OwnedTablesPipeline):
    """``train.pipeline: sync``: every exchange of a step waited for in turn (the reference)."""

    schedule = "sync"


class PrioritizedPipeline(_OwnedTablesPipeline):
    """``train.pipeline: prioritized``: collision rows first, exclusive rows early, deferred
    gradients applied in the next step."""

    schedule = "prioritized"


class _ReplicatedSchedule:
    """The replicated schedule of the same name (``freescale.embedding.replicated``), voting with ``replica``."""

    @staticmethod
    def _schedules() -> dict[str, type]:
        from freescale.embedding.replicated import PIPELINES as REPLICATED_SCHEDULES

        return REPLICATED_SCHEDULES

    @classmethod
    def _schedule(cls, model, optimizer, transport, group, timeline, replica):
        return cls._schedules()[cls.schedule](model, optimizer, transport, group, timeline, replica=replica)


class ReplicaSync(_ReplicatedSchedule, SyncPipeline):
    """``train.pipeline: sync`` under the replica layer."""


class ReplicaPrioritized(_ReplicatedSchedule, PrioritizedPipeline):
    """``train.pipeline: prioritized`` under the replica layer."""


PIPELINES: dict[str, type] = {"sparse_dist": SparseDistPipeline, "base": BasePipeline, "pec": PECPipeline,
                              "sync": SyncPipeline,
                              "prioritized": PrioritizedPipeline}
REPLICATED: dict[str, type] = {"sparse_dist": ReplicaSparseDist, "pec": ReplicaPEC, "sync": ReplicaSync,
                               "prioritized": ReplicaPrioritized}
"""The pipelines under the replica layer, by ``train.pipeline`` (``base`` has no replicated variant)."""


def pipeline_class(name: str, replicated: bool) -> type:
    """The class of ``train.pipeline`` ``name``: its replicated variant when the replica layer is on."""
    if replicated and name not in REPLICATED:
        raise ValueError(f"train.pipeline {name} does not run under the replica layer")
    return (REPLICATED if replicated else PIPELINES)[name]


def build_pipeline(name: str, model: torch.nn.Module, optimizer, device: torch.device, timeline, *,
                   group=None, transport_cfg=None, replica=None, train_cfg=None) -> TrainPipeline:
    """The named pipeline; ``timeline`` receives its phase spans (a NullTimeline when not profiling);
    ``replica``: the replica layer its steps vote with (the replicated variant; None: the plain
    pipeline); ``train_cfg``: the config's train section."""
    return pipeline_class(name, replica is not None).build(model, optimizer, device, timeline, group=group,
                                                          transport_cfg=transport_cfg, replica=replica,
                                                          train_cfg=train_cfg)
