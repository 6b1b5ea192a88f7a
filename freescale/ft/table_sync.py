"""TorchRec's tables across replica groups: every group's changes since the last sync, added up.

TorchRec's sharded tables update their rows inside backward (the optimizer is fused into
fbgemm's kernels), so the replica layer cannot sum a step's row gradients across the groups
before they are applied, as it does for FreeScale's own tables. Each group updates its own
copy with its own batches, and every ``ft.embedding_sync_every`` steps (and at every
checkpoint and at the last step) the copies are made one again: each row some group changed
since the last sync takes every group's change to it, added up as one job would have applied
them. Averaging the copies instead (what TorchRec's ``DMPCollection`` does) would divide a
group's update of a row that only it touched by the number of groups.

How the changes add up depends on the fused optimizer:

- SGD: the weights' changes are summed (``w = w0 + sum_g dw_g``), which is exactly one step
  of the summed gradients when the sync is every step;
- row-wise Adagrad (fbgemm's ``m += mean(g^2); w -= lr g / (sqrt(m) + eps)``): each group
  normalized its own updates by its own momentum, so plain sums would move a row that several
  groups touch further than one job does. Each group's weight change is taken back to the
  gradient it came from, times the learning rate (``dw_g * (sqrt(m_g) + eps)``, ``m_g`` its
  current momentum of the row); those are summed, and so are the momentum changes; the row then
  takes one Adagrad step of the summed gradient with the summed momentum
  (``m = m0 + sum_g dm_g; w = w0 + sum_g dw_g (sqrt(m_g) + eps) / (sqrt(m) + eps)``). A row
  only one group touched ends exactly as that group left it, however many steps it took.

``ft.embedding_sync: average`` averages the groups' copies instead (``w = w0 + sum_g dw_g / R``
over the ``R`` groups in the step, the momentum alike: TorchRec's ``DMPCollection``), kept to
measure against (``scripts/bench_ft_sync.py``).

Per row block (``freescale.ft.rows``) a group keeps, for the rows it touched since the last
sync, their values at that sync (``base``) and the values its own changes count from
(``start``: the same, except in a group that caught up since, whose changes count from the
peer's state it took). Rows go in as the forward pre-hook reports them, before backward writes
them; the rows a step writes are also saved, so that a failed vote puts them back.

The sync is the row exchange of ``freescale.ft.row_exchange`` with each row's change as its
values; a group that catches up in a sync step contributes nothing and takes the result on top
of the peer's state it loads.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from freescale.ft.row_exchange import RowPlan, RowSpace
from freescale.ft.rows import FusedTables

NO_KEYS = torch.zeros(0, dtype=torch.int64)


class _Touched(NamedTuple):
    rows: torch.Tensor
    base: torch.Tensor
    start: torch.Tensor


def _width(t: torch.Tensor) -> int:
    return int(t[0].numel()) if t.dim() > 1 else 1


def _adagrad_eps(kernel) -> float | None:
    """The epsilon of a kernel whose fused optimizer is row-wise Adagrad; None for SGD."""
    if kernel.optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD:
        return float(kernel.optimizer_args.eps)
    if kernel.optimizer == EmbOptimType.EXACT_SGD:
        return None
    raise ValueError(f"the replica layer syncs TorchRec's tables under row-wise Adagrad or SGD, not {kernel.optimizer}")


class TableSync:
    """TorchRec's fused tables under the replica layer (the layer's *table side*)."""

    def __init__(self, tables: FusedTables, *, every: int, checkpoint_every: int, last_step: int,
                 average: bool = False) -> None:
        self.tables = tables
        self.blocks = tables.blocks()
        self.average = average
        self.eps = [None if average else _adagrad_eps(k) for k in tables.kernels for _ in k.embedding_specs]
        # Averaging counts the groups in the step: one more value per row, 1 from each group.
        self.space = RowSpace(tuple(int(b[0].shape[0]) for b in self.blocks),
                              tuple(sum(_width(t) for t in b) + average for b in self.blocks))
        self.every = every
        self.checkpoint_every = checkpoint_every
        self.last_step = last_step
        self._touched: list[_Touched | None] = [None] * len(self.blocks)
        self._saved: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def due(self, step: int) -> bool:
        """A sync step: every ``every`` steps, every checkpoint step and the last."""
        return any(n and step % n == 0 for n in (self.every, self.checkpoint_every)) or step == self.last_step

    # Rows as flat values: a block's tensors side by side ------------------------------------

    def _read(self, block: int, rows: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[rows].reshape(len(rows), _width(t)) for t in self.blocks[block]], dim=1)

    def _write(self, block: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        at = 0
        with torch.no_grad():
            for t in self.blocks[block]:
                w = _width(t)
                t[rows] = values[:, at:at + w].reshape(t[rows].shape)
                at += w

    # The step ------------------------------------------------------------------------------

    def touch(self, touched) -> None:
        """Rows a lookup reads, before backward writes them: saved for a rollback, and kept
        with their values if this group had not touched them since the last sync."""
        for block, ids in touched:
            rows = torch.unique(ids)
            values = self._read(block, rows)
            self._saved.append((block, rows, values))
            kept = self._touched[block]
            new = rows if kept is None else rows[~torch.isin(rows, kept.rows)]
            if not new.numel():
                continue
            first = values[torch.searchsorted(rows, new)]
            if kept is None:
                self._touched[block] = _Touched(new, first, first.clone())
            else:
                self._touched[block] = _Touched(torch.cat([kept.rows, new]), torch.cat([kept.base, first]),
                                                torch.cat([kept.start, first]))

    def keys(self, step: int) -> torch.Tensor:
        """At a sync step, the keys of every row this group touched since the last one."""
        if not self.due(step):
            return NO_KEYS
        parts = [self.space.keys(b, torch.sort(t.rows).values) for b, t in enumerate(self._touched) if t is not None]
        return torch.cat(parts) if parts else NO_KEYS

    def values(self, plan: RowPlan) -> torch.Tensor:
        """This group's change to each row of ``plan`` since the last sync, as it adds up
        (module docstring; zero where none)."""
        out = torch.zeros(plan.size)
        for block, kept in enumerate(self._touched):
            if self.average:
                plan.values(out, block)[:, -1] = 1.0
            if kept is None or not plan.rows(block).numel():
                continue
            rows, where = self._kept_among(kept, plan.rows(block))
            now = self._read(block, rows)
            change = now - kept.start[where]
            if self.eps[block] is not None:  # the weights' change back to its gradient: times sqrt(m) + eps
                change[:, :-1] *= now[:, -1:].sqrt() + self.eps[block]
            if self.average:
                change = torch.cat([change, torch.ones(len(rows), 1)], 1)
            plan.scatter(block, rows, change, out)
        return out

    def apply(self, plan: RowPlan, summed: torch.Tensor) -> None:
        """After a committed sync step: every row of ``plan`` takes the groups' changes on top of
        its value at the last sync."""
        if not plan.keys.numel():
            return
        for block in range(len(self.blocks)):
            rows = plan.rows(block)
            if not rows.numel():
                continue
            base = self._read(block, rows)  # an untouched row is still at its value of the last sync
            kept = self._touched[block]
            if kept is not None:
                mine, where = self._kept_among(kept, rows)
                base[torch.searchsorted(rows, mine)] = kept.base[where]
            changes, eps = plan.values(summed, block), self.eps[block]
            if self.average:
                self._write(block, rows, base + changes[:, :-1] / changes[:, -1:])
                continue
            if eps is None:
                self._write(block, rows, base + changes)
                continue
            momentum = base[:, -1:] + changes[:, -1:]
            self._write(block, rows, torch.cat([base[:, :-1] + changes[:, :-1] / (momentum.sqrt() + eps), momentum], 1))
        self._touched = [None] * len(self.blocks)

    @staticmethod
    def _kept_among(kept: _Touched, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the ``rows`` this group kept, where each sits in ``kept``)."""
        order = torch.argsort(kept.rows)
        sorted_rows = kept.rows[order]
        at = torch.searchsorted(sorted_rows, rows).clamp(max=len(sorted_rows) - 1)
        hit = sorted_rows[at] == rows
        return rows[hit], order[at[hit]]

    def committed(self) -> None:
        self._saved = []

    def rollback(self) -> None:
        """Put back every row the step wrote, as it was before the step."""
        for block, rows, values in reversed(self._saved):
            self._write(block, rows, values)
        self._saved = []

    # What a group that catches up takes ---------------------------------------------------

    def state_dict(self) -> dict:
        return {"rows": [t.rows if t is not None else NO_KEYS for t in self._touched],
                "base": [t.base if t is not None else torch.zeros(0) for t in self._touched]}

    def load_state_dict(self, state: dict) -> None:
        """A peer's touched rows and their values at the last sync (after the tables were
        loaded: this group's own changes count from the peer's values); ``{}``: none."""
        self._saved = []
        self._touched = [None] * len(self.blocks)
        for block, (rows, base) in enumerate(zip(state.get("rows", []), state.get("base", []))):
            if rows.numel():
                self._touched[block] = _Touched(rows, base, self._read(block, rows))
