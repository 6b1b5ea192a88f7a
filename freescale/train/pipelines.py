"""Training pipelines, chosen by ``train.pipeline`` from a small registry.

- ``sparse_dist``: TorchRec's ``TrainPipelineSparseDist``, the baseline. It starts batch
  i+1's input distribution (the id all-to-all) while batch i computes, then blocks on the
  embedding all-to-alls inside forward and backward.
- ``base``: TorchRec's ``TrainPipelineBase``: no overlap, the synchronous reference.
- ``prioritized`` and ``sync``: FreeScale's own row-wise sharded tables with the embedding
  exchanges ordered by priority, or synchronous (``freescale.embedding.pipeline``).

All take ``progress(iterator)`` and return the model's output for the batch they trained.
Evaluation runs the plain model: the forwards a pipeline rewrote are swapped back for it, and
the in-flight batches are untouched.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torchrec.distributed.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist

from freescale.ft.replica import COMMITTED
from freescale.profile.timeline import instrument_phases


class Pipeline:
    """A TorchRec pipeline plus the model it drives."""

    def __init__(self, inner, model: torch.nn.Module) -> None:
        self.inner = inner
        self.model = model

    vote = COMMITTED  # no replica layer here: every step commits

    def progress(self, batches: Iterator):
        return self.inner.progress(batches)

    def drain(self) -> None:
        """Nothing is deferred past a step in TorchRec's pipelines."""

    def close(self) -> None:
        pass

    @contextmanager
    def evaluating(self):
        """The plain model in eval mode; training mode and the pipelined forwards are restored after."""
        with _original_forwards(self.inner):
            self.model.eval()
            try:
                with torch.no_grad():
                    yield self.model
            finally:
                self.model.train()


def _kjt_dists(modules) -> list:
    return [d._dist for m in modules for _, c in m.named_modules() if hasattr(c, "_input_dists")
            for d in c._input_dists if hasattr(d, "_dist")]


@contextmanager
def _original_forwards(inner):
    """Swap a sparse-dist pipeline's rewritten forwards for the originals, and back.

    TorchRec's ``detach()``/``attach()`` would restart the input distribution of the batch in
    flight on re-attach, issuing a collective that is never awaited; swapping the forwards
    leaves the pipeline's in-flight state untouched.
    """
    modules = getattr(inner, "_pipelined_modules", [])
    dists = _kjt_dists(modules)
    pipelined = [m.forward for m in modules], [d.forward for d in dists]
    for m, f in zip(modules, inner._original_forwards if modules else []):
        m.forward = f
    for d, f in zip(dists, inner._original_kjt_dist_forwards if modules else []):
        d.forward = f
    try:
        yield
    finally:
        for m, f in zip(modules, pipelined[0]):
            m.forward = f
        for d, f in zip(dists, pipelined[1]):
            d.forward = f


class _ProfiledSparseDist(TrainPipelineSparseDist):
    """TrainPipelineSparseDist that marks its input-distribution calls on the timeline."""

    def __init__(self, *args, timeline, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._timeline = timeline

    def start_sparse_data_dist(self, *args, **kwargs):
        with self._timeline.span("input_dist"):
            return super().start_sparse_data_dist(*args, **kwargs)

    def wait_sparse_data_dist(self, *args, **kwargs):
        with self._timeline.span("input_dist"):
            return super().wait_sparse_data_dist(*args, **kwargs)


def _sparse_dist(model, optimizer, device, timeline) -> TrainPipelineSparseDist:
    instrument_phases(timeline, model, optimizer)
    return _ProfiledSparseDist(model, optimizer, device, execute_all_batches=False, timeline=timeline)


def _base(model, optimizer, device, timeline) -> TrainPipelineBase:
    instrument_phases(timeline, model, optimizer)
    return TrainPipelineBase(model, optimizer, device)


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


class ReplicaSparseDist(Pipeline):
    """TorchRec's sparse-dist pipeline under the replica layer.

    Each step is voted on (``VotedOptimizer``); the rows its lookups read are saved for the
    layer before backward writes them (``FusedTables``). A batch that was not trained (its step
    was rolled back, or a group catching up took the step with a peer's state) is trained
    again alone, with the plain model's forwards, before the pipeline goes on: the batches
    TorchRec holds in flight carry ids only, so the pipeline resumes where it was.
    """

    def __init__(self, model, optimizer, device, timeline, replica) -> None:
        self.tables = replica.side.tables
        self.voted = VotedOptimizer(optimizer, replica, self._in_hand)
        super().__init__(_sparse_dist(model, self.voted, device, timeline), model)
        self.replica = replica
        self.device = device
        self._drawn: deque = deque()
        self._source: _Drawn | None = None
        self._again = None

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
        self._again = None if self.vote.trained else batch
        return out

    def _in_hand(self):
        """The batch the step trains: one trained again, or the oldest TorchRec has drawn."""
        return self._again if self._again is not None else self._drawn[0]

    def _drawing(self, batches: Iterator) -> _Drawn:
        if self._source is None or self._source.source is not batches:
            self._source = _Drawn(batches, self._drawn)
        return self._source

    def _train_alone(self, batch):
        with _original_forwards(self.inner):
            self.voted.zero_grad()
            losses, out = self.model(batch.to(self.device))
            torch.sum(losses, dim=0).backward()
            self.voted.step()
        return out

    def close(self) -> None:
        self.tables.close()


class _Owned:
    """The pipelines over FreeScale's own tables, with a transport of their own (two lanes)."""

    def __init__(self, prioritized: bool) -> None:
        self.prioritized = prioritized

    def __call__(self, model, optimizer, device, timeline, *, group, transport_cfg, replica=None):
        from freescale.distributed import new_group_like
        from freescale.embedding.pipeline import PIPELINES as OWNED
        from freescale.transport.registry import build_transport

        transport = build_transport(transport_cfg, new_group_like(group), lanes=2)
        kind = OWNED["prioritized" if self.prioritized else "sync"]
        return OwnedPipeline(kind(model, optimizer, transport, group, timeline, replica=replica), transport)


class OwnedPipeline:
    """An ``EmbeddingPipeline`` and the transport it closes."""

    def __init__(self, inner, transport) -> None:
        self.inner = inner
        self.transport = transport
        self.progress = inner.progress
        self.drain = inner.drain
        self.evaluating = inner.evaluating

    @property
    def vote(self):
        """How the last step ended under the replica layer (``freescale.ft.replica.Vote``)."""
        return self.inner.vote

    def close(self) -> None:
        self.transport.close()


PIPELINES: dict[str, Callable] = {"sparse_dist": _sparse_dist, "base": _base,
                                  "prioritized": _Owned(prioritized=True), "sync": _Owned(prioritized=False)}
OWNED_PIPELINES = frozenset({"prioritized", "sync"})


def build_pipeline(name: str, model: torch.nn.Module, optimizer, device: torch.device, timeline, *,
                   group=None, transport_cfg=None, replica=None):
    """The named pipeline; ``timeline`` receives its phase spans (a NullTimeline when not profiling);
    ``replica``: the replica layer the step votes with."""
    if name in OWNED_PIPELINES:
        return PIPELINES[name](model, optimizer, device, timeline, group=group, transport_cfg=transport_cfg,
                               replica=replica)
    if replica is not None and replica.enabled:
        if name != "sparse_dist":
            raise ValueError(f"train.pipeline {name} does not run under the replica layer")
        return ReplicaSparseDist(model, optimizer, device, timeline, replica)
    return Pipeline(PIPELINES[name](model, optimizer, device, timeline), model)
