"""The layout of what replica groups exchange about table rows in a step: pure functions.

Every step under the replica layer, the groups' rank-``r`` ranks (the owners of the same
shard in every group) exchange, over torchft's process group, which rows they contribute and
then one value per row of the union:

1. the *header*: one int64 all-reduce (sum) of ``5 R`` slots, ``R`` = ``ft.num_replicas``.
   Group ``g`` fills slot ``g`` of five parts: a flag (it is in the step's quorum), a flag (its
   batch is in the step), the data cursor it will hold if the step commits (so every group
   learns every other group's cursor with the state it commits), how many row keys it
   contributes, and a flag (it vetoes the step: no group may commit it). A group that is
   catching up is in the quorum with no batch: the batch's three parts are zero.
2. the *keys*: one int64 all-reduce (sum) of every group's sorted keys in its own segment
   (segment ``g`` starts after the counts of groups ``0 .. g-1``; the others are zero there),
   which is an all-gather over an all-reduce. The union is the same on every group.
3. the *values*: one float all-reduce (sum) in the union's layout (``RowPlan``): each group
   writes its rows' values at their places and zeros elsewhere, so every row ends with the
   sum over the groups that touched it.

Keys number the rows of several *blocks* (tables, or the tables of a kernel) one after the
other (``RowSpace``); each block has its own width (values per row), so the values' layout is
the union's rows of block 0, then of block 1, and so on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch


class Header(NamedTuple):
    """What every group said of itself in a step's header."""

    members: torch.Tensor
    """[R] bool: the group is in the step's quorum."""
    present: torch.Tensor
    """[R] bool: the group's batch is in the step."""
    cursors: torch.Tensor
    """[R] int64: the data cursor each present group holds once the step commits."""
    counts: torch.Tensor
    """[R] int64: row keys each group contributes."""
    vetoes: torch.Tensor
    """[R] bool: the group vetoes the step (it is about to load a newer state than the step's)."""


HEADER_PARTS = 5


def pack_header(replicas: int, replica: int, cursor_after: int | None, count: int, veto: bool = False) -> torch.Tensor:
    """This group's header: its slots filled, the others zero (``cursor_after`` None: its batch
    is not in the step, and it contributes no rows; ``veto``: no group may commit the step)."""
    header = torch.zeros(HEADER_PARTS * replicas, dtype=torch.int64)
    header[replica] = 1
    if cursor_after is not None:
        header[replicas + replica] = 1
        header[2 * replicas + replica] = cursor_after
        header[3 * replicas + replica] = count
    header[4 * replicas + replica] = int(veto)
    return header


def read_header(reduced: torch.Tensor, replicas: int) -> Header:
    members, present, cursors, counts, vetoes = reduced.view(HEADER_PARTS, replicas)
    return Header(members.bool(), present.bool(), cursors.clone(), counts.clone(), vetoes.bool())


def pack_keys(keys: torch.Tensor, counts: torch.Tensor, replica: int) -> torch.Tensor:
    """This group's keys in its segment of the all-gather buffer (zeros elsewhere)."""
    out = torch.zeros(int(counts.sum()), dtype=torch.int64)
    start = int(counts[:replica].sum())
    out[start:start + len(keys)] = keys
    return out


@dataclass(frozen=True)
class RowSpace:
    """Blocks of rows numbered one after the other: block ``b`` holds keys
    ``starts[b] .. starts[b] + rows[b] - 1``, each row ``widths[b]`` values wide."""

    rows: tuple[int, ...]
    widths: tuple[int, ...]
    starts: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        starts, at = [], 0
        for n in self.rows:
            starts.append(at)
            at += n
        object.__setattr__(self, "starts", tuple(starts))

    def keys(self, block: int, rows: torch.Tensor) -> torch.Tensor:
        return rows + self.starts[block]


@dataclass(frozen=True)
class RowPlan:
    """The union of the rows the groups contribute in a step, and where each row's values sit
    in the flat buffer the values are summed in."""

    space: RowSpace
    keys: torch.Tensor
    """Sorted unique keys of the union."""
    bounds: tuple[int, ...]
    """Block ``b``'s keys are ``keys[bounds[b]:bounds[b + 1]]``."""

    @property
    def size(self) -> int:
        """Values in the flat buffer."""
        return sum(self.rows(b).numel() * w for b, w in enumerate(self.space.widths))

    def rows(self, block: int) -> torch.Tensor:
        """The union's rows of ``block`` (local rows, sorted)."""
        return self.keys[self.bounds[block]:self.bounds[block + 1]] - self.space.starts[block]

    def values(self, flat: torch.Tensor, block: int) -> torch.Tensor:
        """``block``'s part of a flat buffer, as [rows, width] (a view)."""
        start = sum(self.rows(b).numel() * w for b, w in enumerate(self.space.widths[:block]))
        width = self.space.widths[block]
        return flat[start:start + self.rows(block).numel() * width].view(-1, width)

    def scatter(self, block: int, rows: torch.Tensor, values: torch.Tensor, out: torch.Tensor) -> None:
        """Write ``values`` ([len(rows), width]) of ``block``'s ``rows`` (a subset of the union's)
        into their places of the flat buffer ``out``."""
        if rows.numel():
            self.values(out, block).index_copy_(0, torch.searchsorted(self.rows(block), rows), values)


def plan_rows(space: RowSpace, gathered: torch.Tensor) -> RowPlan:
    """The plan of the union of every group's keys (``gathered``: the reduced keys buffer)."""
    keys = torch.unique(gathered)
    ends = torch.tensor([s + n for s, n in zip(space.starts, space.rows)], dtype=torch.int64)
    bounds = (0, *torch.searchsorted(keys, ends).tolist())
    return RowPlan(space, keys, bounds)


def empty_plan(space: RowSpace) -> RowPlan:
    return RowPlan(space, torch.zeros(0, dtype=torch.int64), (0,) * (len(space.rows) + 1))


def local_sums(rows: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted unique rows, the sum of ``values`` over each row's repeats, in order of appearance)."""
    unique, inverse = torch.unique(rows, return_inverse=True)
    return unique, values.new_zeros((len(unique), values.shape[1])).index_add_(0, inverse, values)
