"""Which rows of the next batch the current batch writes: the collision / exclusive split.

Pure functions over shard-local row ids (what an owner receives after the id all-to-all).
Batch i writes the rows it read (its backward updates them); batch i+1's rows split into

- *collision* rows, also written by batch i: i+1 must read them after i's update, so their
  update and their exchange go first;
- *exclusive* rows, not written by batch i: their values are final once every earlier batch's
  update is in, so they are looked up and sent early, overlapped with batch i's compute.

Batch i's rows that i+1 does not read are *deferred*: their update may wait until before the
next read of them (the next step's early lookup).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowSplit:
    written: torch.Tensor
    """Sorted unique rows batch i writes."""
    collision: torch.Tensor
    """Sorted unique rows read by batch i+1 and written by batch i."""
    exclusive: torch.Tensor
    """Sorted unique rows read by batch i+1 and not written by batch i."""

    @property
    def deferred(self) -> torch.Tensor:
        """Sorted unique rows written by batch i and not read by batch i+1 (computed when asked:
        the pipeline finds them by position instead)."""
        read = torch.cat([self.collision, self.exclusive])
        return self.written[~torch.isin(self.written, read)]

    @property
    def rate(self) -> float:
        """Collision rows / rows batch i+1 reads (0 when it reads none)."""
        read = len(self.collision) + len(self.exclusive)
        return len(self.collision) / read if read else 0.0


def split_rows(written: torch.Tensor, read: torch.Tensor) -> RowSplit:
    """Split the rows ``read`` (batch i+1's ids, any order, repeats allowed) by whether
    ``written`` (batch i's ids) holds them."""
    written = torch.unique(written)
    read = torch.unique(read)
    collide = torch.isin(read, written)
    return RowSplit(written, read[collide], read[~collide])


def in_rows(ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A mask over ``ids``: which of them are among ``rows``."""
    return torch.isin(ids, rows)


class RowMarks:
    """``split_rows`` and ``in_rows`` over a boolean per local row, as TorchRec's PEC finds its
    overlaps (``BooleanOverlapChecker``), with the same results: marking rows and reading the
    marks at ids is cheaper than sorting both sides for ``torch.isin``
    (``scripts/bench_collision_split.py``). The marks are cleared where they were set, so the
    buffer is all False between calls and never zeroed whole."""

    def __init__(self, rows: int, device: torch.device | str = "cpu") -> None:
        self.marks = torch.zeros(max(1, rows), dtype=torch.bool, device=device)

    def split(self, written: torch.Tensor, read: torch.Tensor) -> RowSplit:
        """``split_rows(written, read)``."""
        written, read = torch.unique(written), torch.unique(read)
        collide = self.among(written, read)[0]
        return RowSplit(written, read[collide], read[~collide])

    def among(self, rows: torch.Tensor, *ids: torch.Tensor) -> list[torch.Tensor]:
        """``[in_rows(i, rows) for i in ids]``."""
        self.marks[rows] = True
        try:
            return [self.marks[i] for i in ids]
        finally:
            self.marks[rows] = False
