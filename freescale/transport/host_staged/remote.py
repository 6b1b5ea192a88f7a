"""The part of a collective that crosses hosts: gloo point-to-point on the transport's group.

Transfers with every peer on another host are posted when the collective starts, progress in
gloo's own threads while the proxy moves the local part, and are waited for after it (gloo
tells a send's or receive's completion only through ``wait``).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from freescale.errors import first_line
from freescale.transport.host_staged.memory import view
from freescale.transport.host_staged.scheduler import Op


class RemoteTransferError(RuntimeError):
    """A transfer with a peer on another host failed."""


class RemoteTransfers:
    def __init__(self, rank: int, remote: list[int], global_ranks: list[int], group: dist.ProcessGroup,
                 timeout_s: float) -> None:
        self.rank = rank
        self.remote = remote  # group ranks on other hosts
        self.global_ranks = global_ranks
        self.group = group
        self.timeout = datetime.timedelta(seconds=timeout_s)

    def start(self, op: Op) -> list:
        """Post the sends and receives with the peers on other hosts."""
        works = []
        for peer in self.remote:
            if op.in_bytes[peer]:
                chunk = torch.from_numpy(view(op.send + op.in_offsets[peer], op.in_bytes[peer]))
                works.append(dist.isend(chunk, self.global_ranks[peer], group=self.group))
            if op.out_bytes[peer]:
                chunk = torch.from_numpy(view(op.recv + op.out_offsets[peer], op.out_bytes[peer]))
                works.append(dist.irecv(chunk, self.global_ranks[peer], group=self.group))
        return works

    def finish(self, works: list) -> None:
        """Wait for the transfers ``start`` posted."""
        for w in works:
            try:
                w.wait(self.timeout)
            except RuntimeError as e:
                first = first_line(e)
                raise RemoteTransferError(f"a transfer with another host failed: {first}") from e
