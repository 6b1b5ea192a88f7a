"""The part of a collective that crosses hosts: gloo point-to-point on the transport's group.

Transfers with every peer on another host are posted when the collective starts and progress
in gloo's own threads while the proxy moves the local part. Each collective's transfers carry
a tag of their own, from its (lane, sequence): gloo pairs a send with the first receive
posted for the same peer and tag, and two collectives of different lanes may be in flight at
once, posted in another order on each rank.

Gloo tells a send's or receive's completion only through a blocking ``wait``, so a waiter
thread per lane waits for each collective's transfers in turn, marks it done and wakes the
proxy (``on_done``), which keeps stepping the other collectives meanwhile (a high-lane collective
that passes a normal one still in flight with another host goes on, and so does its peer's
normal one, whichever it runs first). Within a lane the collectives come in the same order on
every rank, so one waiter per lane never waits behind a transfer that cannot complete.
"""

from __future__ import annotations

import datetime
import queue
import threading

import torch
import torch.distributed as dist

from freescale.errors import first_line
from freescale.transport.host_staged.memory import view
from freescale.transport.host_staged.scheduler import Op


TAGS = 2**31 - 1
"""Tags wrap around after this many collectives (far more than are ever in flight at once)."""


class RemoteTransferError(RuntimeError):
    """A transfer with a peer on another host failed."""


class Pending:
    """One collective's transfers with other hosts: ``done`` once every one has completed or
    one has failed (``error``)."""

    def __init__(self, works: list, op: Op | None = None) -> None:
        self.works = works
        self.op = op  # its buffers live as long as gloo may write into them, even past a failure
        self.done = threading.Event()
        self.error: BaseException | None = None
        if not works:
            self.done.set()


class RemoteTransfers:
    def __init__(self, rank: int, remote: list[int], global_ranks: list[int], group: dist.ProcessGroup,
                 timeout_s: float, lanes: int = 1, on_done=lambda: None) -> None:
        self.rank = rank
        self.on_done = on_done  # wakes the proxy: a collective's other-host part is over
        self.lanes = lanes
        self.remote = remote  # group ranks on other hosts
        self.global_ranks = global_ranks
        self.group = group
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._queues: list[queue.SimpleQueue] = []
        self._waiters: list[threading.Thread] = []
        if remote:
            for lane in range(lanes):
                q: queue.SimpleQueue = queue.SimpleQueue()
                thread = threading.Thread(target=self._wait_in_turn, args=(q,), name=f"host_staged-remote-{lane}",
                                          daemon=True)
                thread.start()
                self._queues.append(q)
                self._waiters.append(thread)

    def start(self, op: Op) -> Pending:
        """Post the sends and receives with the peers on other hosts; the lane's waiter marks them done."""
        works = []
        tag = (op.key.seq * self.lanes + op.key.lane) % TAGS
        for peer in self.remote:
            if op.in_bytes[peer]:
                chunk = torch.from_numpy(view(op.send + op.in_offsets[peer], op.in_bytes[peer]))
                works.append(dist.isend(chunk, self.global_ranks[peer], group=self.group, tag=tag))
            if op.out_bytes[peer]:
                chunk = torch.from_numpy(view(op.recv + op.out_offsets[peer], op.out_bytes[peer]))
                works.append(dist.irecv(chunk, self.global_ranks[peer], group=self.group, tag=tag))
        pending = Pending(works, op)
        if works:
            self._queues[op.key.lane].put(pending)
        return pending

    def _wait_in_turn(self, q: queue.SimpleQueue) -> None:
        while (pending := q.get()) is not None:
            try:
                for w in pending.works:
                    w.wait(self.timeout)
            except BaseException as e:  # the proxy raises it
                pending.error = e
            pending.op = None
            pending.done.set()
            self.on_done()

    @staticmethod
    def finish(pending: Pending) -> bool:
        """Whether the transfers are over (without blocking); raises if one failed."""
        if not pending.done.is_set():
            return False
        if pending.error is not None:
            raise RemoteTransferError(f"a transfer with another host failed: {first_line(pending.error)}") \
                from pending.error
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Let the waiters go once they are through what they hold, and wait a little for them.

        A waiter still inside gloo's ``wait`` when the interpreter finalizes aborts the process.
        """
        for q in self._queues:
            q.put(None)
        for thread in self._waiters:
            thread.join(timeout_s)
        self._queues, self._waiters = [], []
