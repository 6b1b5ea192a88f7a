"""``train.pipeline: pec``: TorchRec's prioritized embedding communication (PEC) modules, driven
by a pipeline of FreeScale's own.

TorchRec 1.8.0 ships PEC's modules (``PECEmbeddingCollection``, its row-wise sharder, the
collision handlers, the gradient ops) and no pipeline; later releases add ``TrainPipelinePEC``.
``PECSparseDist`` follows that pipeline's schedule on 1.8.0's ``TrainPipelineSparseDist``. For
batch N, with the item table's rows split into those batch N-1 also reads (overlapping, "OL":
the collision rows) and the rest ("NOL"):

1. N's OL rows are looked up (N-1's OL gradients were applied at the end of the last step),
   and so are the rows of the other sharded modules (the user and side-feature tables);
2. ``overlap_dist`` for N+1: the owners find which of N+1's ids N reads and which of N's
   ids N+1 reads, and send the masks back; N+2's input distribution starts;
3. N-1's deferred NOL gradients start their exchange;
4. forward N;
5. N+2's input distribution is waited for; N-1's NOL gradients are applied (none of them is
   a row N reads); N+1's NOL rows are looked up (N writes none of them);
6. backward N (the gradients are split, nothing is sent); N's OL gradients start their
   exchange; the dense optimizer steps beside it; N's OL gradients are applied; N's NOL
   gradients are deferred to step N+1.

``drain()`` applies the NOL gradients still deferred (before evaluation, a checkpoint, the end).
Every gradient is applied by ``compat.apply_pec_gradient``: as TorchRec's standard path applies
its gradients (``train.pec_corrections``), or as PEC ships (``docs/pec.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torchrec.distributed.pec_embedding import ShardedPECEmbeddingCollection
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.train_pipeline.pipeline_context import EmbeddingTrainPipelineContext
from torchrec.distributed.train_pipeline.runtime_forwards import InSyncEmbeddingPipelinedForward
from torchrec.distributed.types import LazyNoWait

from freescale import compat
from freescale.train.sparse_dist import ProfiledSparseDist


@dataclass
class PECContext(EmbeddingTrainPipelineContext):
    """One batch's state in the pipeline; each dict is keyed by the PEC module's name.

    ``dist_inputs``: its features after the input distribution (the next batch's overlap is
    found against them); ``forward``/``backward``: the partitions of its lookup and of its
    gradient (one per sharding group); ``ol``/``nol``: the partitions' output all-to-alls;
    ``deferred_from``: the previous batch, whose NOL gradients this batch's step applies.
    """

    dist_inputs: dict[str, Any] = field(default_factory=dict)
    forward: dict[str, Any] = field(default_factory=dict)
    backward: dict[str, Any] = field(default_factory=dict)
    ol: dict[str, Any] = field(default_factory=dict)
    nol: dict[str, Any] = field(default_factory=dict)
    deferred_from: PECContext | None = None


class PECForward(InSyncEmbeddingPipelinedForward):
    """The rewritten forward of the pipelined modules: a PEC module merges the OL and NOL
    lookups the pipeline made ahead for the batch; the others return their precomputed
    output all-to-all, their gradients flowing in backward as in ``sparse_dist`` (TorchRec's
    own forward for them asks for a CUDA stream)."""

    def __call__(self, *args, **kwargs):
        ctx, name = self._context, self._name
        if not isinstance(self._module, ShardedPECEmbeddingCollection):
            ctx.module_contexts.pop(name)
            return LazyNoWait(ctx.embedding_a2a_requests.pop(name).wait())
        return self._module.merge_partitioned_embeddings(
            ctx.module_contexts[name], ctx.ol.pop(name), ctx.nol.pop(name), ctx.forward.pop(name),
            ctx.backward[name])


class PECSparseDist(ProfiledSparseDist):
    """TorchRec's sparse-dist pipeline with the item table's rows looked up and updated in
    PEC's order (the module docstring); ``corrected``: ``compat.apply_pec_gradient``'s
    corrections on; ``timeline`` gets the input distribution and PEC's waits as spans."""

    _pipelined_forward_type = PECForward

    def __init__(self, model, optimizer, device: torch.device, *, timeline, corrected: bool = True) -> None:
        compat.require_methods(TrainPipelineSparseDist, "_pipeline_model", "_init_pipelined_modules",
                               "_set_module_context", "enqueue_batch", "dequeue_batch", "_backward")
        super().__init__(model, optimizer, device, execute_all_batches=False, context_type=PECContext,
                         timeline=timeline)
        self._corrected = corrected
        self._pec: dict[str, ShardedPECEmbeddingCollection] = {}
        self._world_size = 1
        self._deferred_onto: PECContext | None = None  # the context holding the last step's NOL gradients

    # The rewritten model ----------------------------------------------------------------------

    def _pipeline_model(self, batch, context, pipelined_forward=PECForward) -> None:
        super()._pipeline_model(batch, context, pipelined_forward)
        self._pec = {m.forward.name: m for m in self._pipelined_modules
                     if isinstance(m, ShardedPECEmbeddingCollection)}
        if not self._pec:
            raise ValueError("train.pipeline pec: the model holds no PECEmbeddingCollection")
        for module in self._pec.values():
            self._world_size = compat.private(module, "_env", compat.PEC_PURPOSE).world_size

    # PEC's stages -----------------------------------------------------------------------------

    def _overlap_dist(self, current: PECContext | None, prev: PECContext | None) -> None:
        """Split ``current``'s lookup and ``prev``'s gradient by their overlap (first batch:
        ``prev`` None; after the last: ``current`` None, all of ``prev``'s gradient is NOL)."""
        with self._timeline.span("overlap_dist"):
            for name, pec in self._pec.items():
                dist_input = module_ctx = prev_ctx = prev_input = None
                if current is not None:
                    dist_input = current.input_dist_tensors_requests.pop(name).wait()
                    current.dist_inputs[name] = dist_input
                    module_ctx = current.module_contexts[name]
                if prev is not None:
                    prev_ctx, prev_input = prev.module_contexts[name], prev.dist_inputs[name]
                forward, backward = [], []
                for result in pec.overlap_dist(ctx=module_ctx, dist_input=dist_input, prev_ctx=prev_ctx,
                                               prev_dist_input=prev_input):
                    fwd, bwd = result.wait()
                    if fwd is not None:
                        forward.append(fwd)
                    if bwd is not None:
                        backward.append(bwd)
                if current is not None:
                    current.forward[name] = forward
                if prev is not None:
                    prev.backward[name] = backward
                    self._note_collisions(backward)

    def _note_collisions(self, backward: list) -> None:
        """The share of a batch's rows the next reads, on this owner (the bubble report's rate)."""
        ol = sum(int(b.ol_features.values().numel()) for b in backward)
        read = ol + sum(int(b.nol_features.values().numel()) for b in backward)
        self._timeline.note("collision_rows", ol)
        self._timeline.note("read_rows", read)

    def _lookup(self, ctx: PECContext, overlapped: bool) -> None:
        """Look up one partition of ``ctx``'s rows and start its output all-to-all."""
        for name, pec in self._pec.items():
            forward = ctx.forward[name]
            compat.one_sharding_group(forward)
            part = forward[0].ol_features if overlapped else forward[0].nol_features
            awaitables = pec.compute_and_output_dist_in_partition(ctx.module_contexts[name], part, forward[0].splits,
                                                                  is_overlapped=overlapped)
            (ctx.ol if overlapped else ctx.nol)[name] = awaitables

    def _other_lookups(self, ctx: PECContext) -> None:
        """The other pipelined modules' lookups and output all-to-alls (as ``sparse_dist``
        makes them inside forward)."""
        for module in self._pipelined_modules:
            if isinstance(module, ShardedPECEmbeddingCollection):
                continue
            name = module.forward.name
            kjt = ctx.input_dist_tensors_requests[name].wait()
            ctx.embedding_a2a_requests[name] = module.compute_and_output_dist(ctx.module_contexts[name], kjt)

    def _gradients(self, ctx: PECContext, overlapped: bool) -> list:
        """Start the exchange of one partition of ``ctx``'s gradients; returns what applies them."""
        started = []
        for name in self._pec:
            info = ctx.module_contexts[name].autograd_ctx_per_sharding
            for autograd_ctx, part, sharding_ctx in zip(info, ctx.backward[name],
                                                        ctx.module_contexts[name].sharding_contexts):
                applier = autograd_ctx.ol_grad_apply if overlapped else autograd_ctx.nol_grad_apply
                applier.dist()
                started.append((self._pec[name], applier, part.ol_features if overlapped else part.nol_features,
                                sharding_ctx))
        return started

    def _apply(self, started: list, kind: str) -> None:
        with self._timeline.span(kind):
            for pec, applier, features, sharding_ctx in started:
                compat.apply_pec_gradient(pec, applier, features, sharding_ctx, world_size=self._world_size,
                                          corrected=self._corrected)

    # The step ---------------------------------------------------------------------------------

    def fill_pipeline(self, dataloader_iter: Iterator) -> None:
        """Batch 0: its input distribution, overlap (against nothing) and NOL lookup; batch 1:
        its input distribution started and its splits waited for (nothing once filled)."""
        if self.batches:
            return
        if not self.enqueue_batch(dataloader_iter):
            return
        self._init_pipelined_modules(self.batches[0], self.contexts[0], self._pipelined_forward_type)
        self.wait_sparse_data_dist(self.contexts[0])
        self._overlap_dist(self.contexts[0], None)
        self._lookup(self.contexts[0], overlapped=False)
        if not self.enqueue_batch(dataloader_iter):
            return
        self.start_sparse_data_dist(self.batches[1], self.contexts[1])
        self.wait_sparse_data_dist(self.contexts[1])

    def progress(self, dataloader_iter: Iterator):
        self.fill_pipeline(dataloader_iter)
        if not self.batches:
            raise StopIteration
        ctx0: PECContext = self.contexts[0]
        ctx1: PECContext | None = self.contexts[1] if len(self.contexts) > 1 else None
        self._set_module_context(ctx0)
        self.enqueue_batch(dataloader_iter)
        with self._timeline.span("collision_lookup"):
            self._lookup(ctx0, overlapped=True)
            self._other_lookups(ctx0)
        self._overlap_dist(ctx1, ctx0)
        if len(self.batches) > 2:
            self.start_sparse_data_dist(self.batches[2], self.contexts[2])
        deferred = self._start_deferred(ctx0)
        if self._model.training:
            self._optimizer.zero_grad()
        losses, output = self._model_fwd(self.batches[0])
        if len(self.batches) > 2:
            self.wait_sparse_data_dist(self.contexts[2])
        self._apply(deferred, "deferred_wait")
        if ctx1 is not None and self._look_ahead_now():
            self._lookup(ctx1, overlapped=False)
        if self._model.training:
            self._backward(losses)
            self._update(ctx0, ctx1)
        self.dequeue_batch()
        return output

    def _look_ahead_now(self) -> bool:
        """Whether the next batch's NOL rows are looked up during this step (PEC's schedule:
        the current batch writes none of them)."""
        return True

    def _update(self, ctx0: PECContext, ctx1: PECContext | None) -> None:
        """After backward: the OL gradients exchanged beside the dense optimizer's step and
        applied; the NOL gradients deferred onto the next batch's step."""
        collisions = self._gradients(ctx0, overlapped=True)
        self._optimizer.step()
        self._apply(collisions, "collision_wait")
        self._deferred_onto = ctx1 if ctx1 is not None else ctx0
        self._deferred_onto.deferred_from = ctx0
        if ctx1 is None:  # the last batch: nothing follows to apply them
            self.drain()

    def _start_deferred(self, ctx: PECContext) -> list:
        """Start the exchange of the NOL gradients deferred onto ``ctx`` (nothing on the first step)."""
        owner, ctx.deferred_from = ctx.deferred_from, None
        self._deferred_onto = None
        return [] if owner is None else self._gradients(owner, overlapped=False)

    def drain(self) -> None:
        """Apply the NOL gradients the last step deferred: the tables then hold every update."""
        if self._deferred_onto is not None:
            self._apply(self._start_deferred(self._deferred_onto), "deferred_wait")


class ReplicatedPECSparseDist(PECSparseDist):
    """``PECSparseDist`` under the replica layer (``pipelines.ReplicaPEC``): a step ends at
    its vote, so everything it writes is written before it.

    - Batch N's NOL gradients are exchanged right after its OL gradients and applied after
      them, before the vote (``optimizer.step``: ``VotedOptimizer``), not deferred onto step
      N+1: a rolled-back step puts back every row it wrote, a sync counts every change of its
      batches, and a peer's snapshot holds every update of the steps it has.
    - Batch N+1's NOL rows are looked up during step N (as PEC does) unless step N is one at
      which the tables may change under them at the vote (``may_change(step)``: a sync step
      adds the groups' changes to them); then, and after a vote that rewrote the tables (a
      catch-up), they are looked up once step N's vote is in (``look_ahead``). A rolled-back
      step keeps them: batch N, trained again, writes none of them.
    """

    def __init__(self, *args, may_change, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._may_change = may_change  # () -> bool: the tables may change at this step's vote

    def _look_ahead_now(self) -> bool:
        return not self._may_change()

    def _update(self, ctx0: PECContext, ctx1: PECContext | None) -> None:
        collisions = self._gradients(ctx0, overlapped=True)
        rest = self._gradients(ctx0, overlapped=False)
        self._apply(collisions, "collision_wait")
        self._apply(rest, "exclusive_wait")
        self._optimizer.step()

    def look_ahead(self, anew: bool) -> None:
        """After a vote that trained the step's batch: the next batch's NOL rows, looked up if
        the step did not (``anew``: looked up again, the tables were rewritten since)."""
        if not self.contexts:
            return
        ctx = self.contexts[0]
        looked = [name for name in self._pec if name in ctx.nol]
        if looked and not anew:
            return
        for name in looked:  # the stale lookup's all-to-alls, finished and dropped
            for awaitable in ctx.nol.pop(name):
                awaitable.wait()
        self._lookup(ctx, overlapped=False)
