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
