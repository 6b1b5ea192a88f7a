"""The private TorchRec attributes FreeScale reads, in one place, checked against the pinned versions.

FreeScale touches TorchRec's internals at two seams, both below any public API:

- evaluation under ``TrainPipelineSparseDist`` swaps the forwards the pipeline rewrote
  (``_pipelined_modules``, ``_original_forwards``, and the input distributions' KJT
  all-to-alls: ``_input_dists``, ``_dist``, ``_original_kjt_dist_forwards``) for the originals
  and back, which leaves the batches in flight untouched (``original_forwards``);
- the replica layer reads and writes the rows of fbgemm's fused kernels inside DMP's sharded
  embedding modules (``_lookups``, ``_emb_modules``, ``_emb_module``: ``sharded_kernels``);

and it overrides two of ``TrainPipelineSparseDist``'s methods to mark the input distribution
on the timeline (``require_methods``).

``train.pipeline: pec`` drives TorchRec's PEC modules and applies their gradients itself
(``apply_pec_gradient``), correcting two differences from TorchRec's standard path that make
PEC as shipped train other numbers than ``sparse_dist`` (docs/pec.md).

The stack is pinned (``scripts/setup.sh``); another version only logs a warning, once. When an
attribute is gone, the error names it, the object's type, what FreeScale reads it for, and the
versions found against the pinned ones: the place to adapt is this module.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

PINNED = {"torchrec": "1.8.0", "fbgemm-gpu": "1.8.0"}
"""The versions this module was written against (``scripts/setup.sh`` installs them)."""

FBGEMM_DISTRIBUTIONS = ("fbgemm-gpu", "fbgemm-gpu-cpu")
"""fbgemm's CUDA and CPU builds: the same package under two distribution names."""

log = logging.getLogger("freescale")


class PrivateAttributeMissing(RuntimeError):
    """A private TorchRec attribute FreeScale reads is not where the pinned version keeps it."""


def installed_versions() -> dict[str, str | None]:
    """The installed versions of the pinned distributions (None: not installed)."""
    found: dict[str, str | None] = {"torchrec": _version("torchrec"), "fbgemm-gpu": None}
    for name in FBGEMM_DISTRIBUTIONS:
        found["fbgemm-gpu"] = found["fbgemm-gpu"] or _version(name)
    return found


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions_line(found: dict[str, str | None] | None = None) -> str:
    """``TorchRec 1.9.0 (pinned 1.8.0), fbgemm-gpu 1.8.0 (pinned 1.8.0)``."""
    found = installed_versions() if found is None else found
    names = {"torchrec": "TorchRec", "fbgemm-gpu": "fbgemm-gpu"}
    return ", ".join(f"{names[d]} {found[d] or 'not installed'} (pinned {PINNED[d]})" for d in PINNED)


@functools.cache
def check_versions() -> bool:
    """Whether the installed versions are the pinned ones; logs a warning (once) when not."""
    found = installed_versions()
    if found == PINNED:
        return True
    log.warning(f"{versions_line(found)}: FreeScale reads private TorchRec attributes (freescale/compat.py) "
                f"that another version may have moved")
    return False


def private(obj: object, name: str, purpose: str):
    """``obj.name``, or an error naming the attribute, ``obj``'s type, ``purpose`` and the versions."""
    check_versions()
    try:
        return getattr(obj, name)
    except AttributeError:
        raise PrivateAttributeMissing(
            f"{versions_line()}: {type(obj).__name__} has no attribute {name}; FreeScale reads it {purpose} "
            f"(adapt freescale/compat.py to the installed version, or install the pinned one)") from None


def require_methods(cls: type, *names: str) -> None:
    """Raise unless ``cls`` has the methods ``names`` (a subclass overrides them: a renamed one
    would silently never be called)."""
    for name in names:
        if not callable(private(cls, name, f"to override it in a subclass of {cls.__name__}")):
            raise PrivateAttributeMissing(f"{versions_line()}: {cls.__name__}.{name} is not a method")


# The sparse-dist pipeline's rewritten forwards -------------------------------------------------

_SWAP = "to run the plain model during evaluation without disturbing the batches in flight"


@dataclass
class Forwards:
    """Modules and the forwards they get back: the pipelined sharded modules, and the KJT
    all-to-alls of their input distributions."""

    modules: list[torch.nn.Module]
    originals: list[Callable]
    kjt_dists: list[torch.nn.Module]
    kjt_dist_originals: list[Callable]


def pipeline_forwards(pipeline) -> Forwards:
    """What a ``TrainPipelineSparseDist`` rewrote, and the forwards it saved (nothing before its
    first batch). The KJT all-to-alls are found as TorchRec's ``_override_input_dist_forwards``
    finds them, and must match the forwards it saved one for one."""
    modules = list(private(pipeline, "_pipelined_modules", _SWAP))
    if not modules:
        return Forwards([], [], [], [])
    dists = [private(d, "_dist", _SWAP) for m in modules for _, c in m.named_modules() if hasattr(c, "_input_dists")
             for d in private(c, "_input_dists", _SWAP) if hasattr(d, "_dist")]
    forwards = Forwards(modules, list(private(pipeline, "_original_forwards", _SWAP)), dists,
                        list(private(pipeline, "_original_kjt_dist_forwards", _SWAP)))
    if len(forwards.originals) != len(modules) or len(forwards.kjt_dist_originals) != len(dists):
        raise PrivateAttributeMissing(
            f"{versions_line()}: {type(pipeline).__name__} saved {len(forwards.originals)} module and "
            f"{len(forwards.kjt_dist_originals)} input-distribution forwards for {len(modules)} pipelined modules "
            f"and {len(dists)} KJT all-to-alls found in them: the pipeline rewrites the model differently")
    return forwards


@contextmanager
def original_forwards(pipeline):
    """Swap a sparse-dist pipeline's rewritten forwards for the originals, and back.

    TorchRec's ``detach()``/``attach()`` would restart the input distribution of the batch in
    flight on re-attach, issuing a collective that is never awaited; swapping the forwards
    leaves the pipeline's in-flight state untouched.
    """
    saved = pipeline_forwards(pipeline)
    pipelined = [m.forward for m in saved.modules], [d.forward for d in saved.kjt_dists]
    for m, f in zip(saved.modules, saved.originals):
        m.forward = f
    for d, f in zip(saved.kjt_dists, saved.kjt_dist_originals):
        d.forward = f
    try:
        yield
    finally:
        for m, f in zip(saved.modules, pipelined[0]):
            m.forward = f
        for d, f in zip(saved.kjt_dists, pipelined[1]):
            d.forward = f


# fbgemm's kernels inside DMP's sharded modules ------------------------------------------------

_ROWS = "to save, restore and average the fused kernels' rows under the replica layer"
SHARDED_EMBEDDING_MODULES = (ShardedEmbeddingCollection, ShardedEmbeddingBagCollection)
"""The sharded modules ``model.sharding``'s sharders make."""


def sharded_kernels(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The fbgemm kernels of every lookup of ``model``'s sharded embedding modules, in module
    order (a data-parallel lookup is unwrapped from its DDP)."""
    kernels = []
    for module in model.modules():
        if not isinstance(module, SHARDED_EMBEDDING_MODULES):
            continue
        for lookup in private(module, "_lookups", _ROWS):
            if isinstance(lookup, DistributedDataParallel):
                lookup = lookup.module
            kernels += [private(emb, "_emb_module", _ROWS) for emb in private(lookup, "_emb_modules", _ROWS)]
    return kernels


# TorchRec's PEC modules ------------------------------------------------------------------------

PEC_PURPOSE = "to drive TorchRec's PEC modules (train.pipeline pec)"


def one_sharding_group(partitions: list) -> None:
    """Raise unless PEC split the lookup into one sharding group: 1.8.0's
    ``compute_and_output_dist_in_partition`` looks every group up with the same partition."""
    if len(partitions) != 1:
        raise PrivateAttributeMissing(
            f"{versions_line()}: a PEC module has {len(partitions)} sharding groups; train.pipeline pec drives "
            f"one (the item table, row-wise)")


def rank_major_to_feature_major(grad: torch.Tensor, lengths: torch.Tensor, recat: torch.Tensor) -> torch.Tensor:
    """``grad``'s rows, received from the ranks one after another (rank-major: rank 0's rows of
    every feature, then rank 1's), in the order the owner's lookup holds them (feature-major:
    feature 0's rows from every rank, then feature 1's). ``lengths``: the lookup's KJT lengths
    (feature-major, ``recat.numel()`` segments); ``recat``: the batch's
    ``sparse_features_recat``, which TorchRec's sequence all-to-all inverts to go from the
    lookup's order to the ranks'. The rows are moved, never summed: the values are unchanged."""
    to_ranks = torch.ops.fbgemm.invert_permute(recat)
    rows = torch.arange(grad.shape[0], dtype=torch.int64, device=grad.device)
    _, order, _ = torch.ops.fbgemm.permute_2D_sparse_data(to_ranks, lengths.view(to_ranks.numel(), -1), rows, None,
                                                          rows.numel())
    # order[k]: the lookup's row that the k-th received row belongs to.
    return torch.empty_like(grad).index_copy_(0, order, grad)


def apply_pec_gradient(module, applier, features, sharding_ctx, *, world_size: int, corrected: bool = True) -> None:
    """Wait for one partition of a PEC module's gradient exchange (``applier``: TorchRec's
    ``PECGradientApply``, its exchange started) and apply it to the fused table by looking
    ``features`` up again and running the kernel's backward, as ``PECGradientApply.apply`` does.

    ``corrected`` applies the gradient as TorchRec's standard sequence all-to-all
    (``All2All_Seq_Req.backward``) does, where TorchRec 1.8.0's ``PECGradientApply`` does not:

    1. **Order.** The gradient arrives rank-major, and the re-lookup is of the owner's
       features, feature-major. With one feature per table the two orders agree; with more
       (the history and the candidates share the item table) PEC applies each row's gradient
       to another row. The standard path permutes the received rows back by the batch's
       recat; so does this (``rank_major_to_feature_major``).
    2. **Scale.** The standard path divides the received gradient by the group's size
       (``torchrec.distributed.comm_ops.GRADIENT_DIVISION``, on by default); PEC does not, so
       its updates are ``world_size`` times larger (row-wise Adagrad's state ``world_size``
       squared). This divides when TorchRec's setting says to.
    """
    from torchrec.distributed.comm_ops import get_gradient_division

    work = private(applier, "_work", PEC_PURPOSE)
    buffer = private(applier, "_grad_buffer", PEC_PURPOSE)
    if work is None or buffer is None:
        raise PrivateAttributeMissing(f"{versions_line()}: a PEC gradient is applied before its exchange started")
    ec = private(module, "_embedding_collection", PEC_PURPOSE)
    lookup, dim = private(ec, "_lookups", PEC_PURPOSE)[0], _dim(ec)
    if not corrected:
        applier.apply(features, lookup, dim)
        return
    work.wait()
    grad = rank_major_to_feature_major(buffer.view(-1, dim), features.lengths(),
                                       private(sharding_ctx, "sparse_features_recat", PEC_PURPOSE))
    if get_gradient_division():
        grad = grad.div_(world_size)
    if features.values().numel() > 0:
        with torch.enable_grad():
            embs = lookup(features).view(-1, dim)
            if embs.numel() > 0:
                embs.backward(grad)
    applier._work = None
    applier._grad_buffer = None


def _dim(ec) -> int:
    """The row width of a sharded EmbeddingCollection's (one) row-wise sharding group."""
    sharding_type = next(iter(private(ec, "_sharding_type_to_sharding", PEC_PURPOSE)))
    return private(ec, "_embedding_dim_for_sharding_type", PEC_PURPOSE)(sharding_type)
