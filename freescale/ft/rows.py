"""The per-row state of fbgemm's table-batched kernels, for the replica layer to save, restore
and average.

Both kinds of tables the trainer holds end in fbgemm's ``SplitTableBatchedEmbeddingBagsCodegen``
with the optimizer fused into backward: FreeScale's own ``ShardedTables`` hold one kernel,
TorchRec's sharded collections one per group of tables inside ``DistributedModelParallel``.
A kernel's state is, per table, its weights and the optimizer's per-row state (row-wise
Adagrad's ``momentum1``), all views of the kernel's storage: a *row block*, a list of tensors
whose first dimension is the table's local rows. Writing into a row block writes the table.

``FusedTables`` finds the kernels of a TorchRec model and reports the rows each lookup reads
(the rows the fused update will write in backward) to whoever asks, through a forward
pre-hook on the kernel: the ids arrive there already local, after TorchRec's input
distribution.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

from freescale.compat import sharded_kernels

RowBlock = list
"""A table's per-row tensors (weights first, then the optimizer's per-row state), views of its kernel."""


def kernel_blocks(kernel: SplitTableBatchedEmbeddingBagsCodegen) -> list[RowBlock]:
    """One row block per table of ``kernel``."""
    weights = kernel.split_embedding_weights()
    try:
        states = kernel.split_optimizer_states()
    except NotImplementedError:  # a kernel without an optimizer holds weights only
        states = []
    return [[w, *s] for w, s in zip(weights, states or [[] for _ in weights])]  # (SGD: no state, [])


def rows_per_table(kernel: SplitTableBatchedEmbeddingBagsCodegen, indices: torch.Tensor, offsets: torch.Tensor,
                   batch_size_per_feature_per_rank: list[list[int]] | None = None) -> list[torch.Tensor]:
    """The local rows of each of ``kernel``'s tables that one call with ``indices`` / ``offsets``
    reads (repeats kept). Features map to tables by the kernel's ``feature_table_map``; each
    feature holds ``batch`` bags of ``offsets`` (a variable batch per feature when given)."""
    tables = len(kernel.embedding_specs)
    if tables == 1:
        return [indices]
    feature_table = list(kernel.feature_table_map)
    if batch_size_per_feature_per_rank is not None:
        bags = [sum(b) for b in batch_size_per_feature_per_rank]
    else:
        bags = [(offsets.numel() - 1) // len(feature_table)] * len(feature_table)
    per_table: list[list[torch.Tensor]] = [[] for _ in range(tables)]
    start = 0
    for feature, count in enumerate(bags):
        lo, hi = int(offsets[start]), int(offsets[start + count])
        per_table[feature_table[feature]].append(indices[lo:hi])
        start += count
    return [torch.cat(parts) if parts else indices[:0] for parts in per_table]


def find_kernels(model: torch.nn.Module) -> list[SplitTableBatchedEmbeddingBagsCodegen]:
    """The fused fbgemm kernels of a TorchRec model's sharded embedding modules, in module order."""
    kernels = []
    for kernel in sharded_kernels(model):
        if isinstance(kernel, SplitTableBatchedEmbeddingBagsCodegen) and kernel not in kernels:
            kernels.append(kernel)
    return kernels


Touched = list
"""(block index, local rows) pairs: the rows of each block (as ``FusedTables.blocks()`` numbers
them) a lookup reads, which the fused update then writes."""


class FusedTables:
    """The fused kernels of a TorchRec model, as row blocks, and the rows their lookups read.

    ``reporting(sink)``: while inside, every lookup calls ``sink`` with the (block index, rows)
    pairs it reads, before the kernel runs (hence before backward writes them).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.kernels = find_kernels(model)
        self._first_block = {}
        count = 0
        for kernel in self.kernels:
            self._first_block[id(kernel)] = count
            count += len(kernel.embedding_specs)
        if not self.kernels:
            raise ValueError("the model holds no fused fbgemm embedding kernel whose rows the replica layer can "
                             "save and average (TorchRec's sharded tables with the optimizer fused into backward)")
        self._sink: Callable[[Touched], None] | None = None
        self._hooks = [k.register_forward_pre_hook(self._looking_up, with_kwargs=True) for k in self.kernels]

    def blocks(self) -> list[RowBlock]:
        """Every table's row block."""
        return [b for k in self.kernels for b in kernel_blocks(k)]

    @contextmanager
    def reporting(self, sink: Callable[[Touched], None]):
        self._sink = sink
        try:
            yield
        finally:
            self._sink = None

    def _looking_up(self, kernel, args, kwargs) -> None:
        if self._sink is None:
            return
        indices = kwargs["indices"] if "indices" in kwargs else args[0]
        offsets = kwargs["offsets"] if "offsets" in kwargs else args[1]
        rows = rows_per_table(kernel, indices, offsets, kwargs.get("batch_size_per_feature_per_rank"))
        first = self._first_block[id(kernel)]
        self._sink([(first + t, r) for t, r in enumerate(rows)])

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
