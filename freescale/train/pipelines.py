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

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torchrec.distributed.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist

from freescale.ft.replica import COMMITTED


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
    return _ProfiledSparseDist(model, optimizer, device, execute_all_batches=False, timeline=timeline)


def _base(model, optimizer, device, timeline) -> TrainPipelineBase:
    return TrainPipelineBase(model, optimizer, device)


class _Owned:
    """The pipelines over FreeScale's own tables, with a transport of their own (two lanes)."""

    def __init__(self, prioritized: bool) -> None:
        self.prioritized = prioritized

    def __call__(self, model, optimizer, device, timeline, *, group, transport_cfg, replica=None):
        from freescale.distributed import new_group_like
        from freescale.embedding.pipeline import EmbeddingPipeline
        from freescale.transport.registry import build_transport

        transport = build_transport(transport_cfg, new_group_like(group), lanes=2)
        return OwnedPipeline(EmbeddingPipeline(model, optimizer, transport, group, timeline,
                                               prioritized=self.prioritized, replica=replica), transport)


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
    ``replica``: the replica layer the step votes with (owned pipelines)."""
    if name in OWNED_PIPELINES:
        return PIPELINES[name](model, optimizer, device, timeline, group=group, transport_cfg=transport_cfg,
                               replica=replica)
    return Pipeline(PIPELINES[name](model, optimizer, device, timeline), model)
