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
"""

from __future__ import annotations

import torch

from freescale.embedding.exchange import ShardedTables
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
