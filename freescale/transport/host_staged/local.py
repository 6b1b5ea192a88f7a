"""One collective's exchange with the peers on this host, as a state machine.

Towards each peer, a message smaller than a ring chunk (every message, with ``shm_ring``) is
written into the pair's ring and announced with a POST, which doubles as the first chunks'
doorbell; the sender is done once the last chunk is in. A larger one (``mapped``) is
announced with a POST too; the receiver answers with where in its result it goes (WANT), the
sender copies it there and says DONE: one copy instead of two. A receiver whose result is
not a memory file (a pinned staging buffer, or a pool that is all in use) answers "use the
ring" instead. Receivers send their WANTs as soon as the collective starts, which saves the
senders a round trip.

``step()`` makes what progress it can without blocking and says whether it made any; the
caller sleeps on the wire between steps and checks liveness and the timeout. Every sender
announces its message's size, so splits that disagree between ranks fail with both sizes
named.
"""

from __future__ import annotations

import ctypes

from freescale.transport.host_staged.memory import BufferPool, PeerFiles, Ring, pump
from freescale.transport.host_staged.scheduler import Op
from freescale.transport.host_staged.wire import Wire


class SplitMismatch(RuntimeError):
    """This rank's split for a peer disagrees with the peer's."""


class LocalExchange:
    __slots__ = ("op", "key", "rank", "wire", "inbound", "outbound", "pool", "peer_files", "chunk", "mapped",
                 "unread", "received", "direct", "unanswered", "ring_sent", "unannounced", "own_copied")

    def __init__(self, op: Op, rank: int, wire: Wire, inbound: dict[int, Ring], outbound: dict[int, Ring],
                 pool: BufferPool, peer_files: PeerFiles, *, chunk: int, mapped: bool) -> None:
        self.op = op
        self.key = op.key
        self.rank = rank
        self.wire = wire
        self.inbound = inbound
        self.outbound = outbound
        self.pool = pool
        self.peer_files = peer_files
        self.chunk = chunk
        self.mapped = mapped
        peers = wire.peers
        # As a receiver.
        self.unread = set(peers)  # peers whose message has not fully arrived
        self.received = dict.fromkeys(peers, 0)  # peer -> bytes of its message in the result so far
        self.direct: set[int] = set()  # peers that write straight into the result
        # As a sender.
        self.unanswered: set[int] = set()  # large messages waiting for their receiver's WANT
        self.ring_sent: dict[int, int] = {}  # peer -> bytes written into its ring so far (until all are)
        self.unannounced: set[int] = set()  # ring messages not POSTed yet
        self.own_copied = False

    def start(self) -> None:
        """Say where large messages go (as a receiver) and announce this rank's messages (as a sender)."""
        op, key, wire = self.op, self.key, self.wire
        file = self.pool.file_of(op.recv) if self.mapped else None
        for s in wire.peers:
            if self.mapped and op.out_bytes[s] >= self.chunk:
                if file is not None:
                    wire.want(s, key, file[0], file[1], op.out_offsets[s], op.out_bytes[s])
                    self.direct.add(s)
                else:
                    wire.want(s, key, 0, 0, 0, op.out_bytes[s])
        for d in wire.peers:
            if self.mapped and op.in_bytes[d] >= self.chunk:
                wire.post(d, key, True, op.in_bytes[d])
                self.unanswered.add(d)
            else:
                self.ring_sent[d] = 0
                self.unannounced.add(d)

    @property
    def done(self) -> bool:
        return not (self.unread or self.unanswered or self.ring_sent)

    def waiting_for(self) -> set[int]:
        """Peers this rank still sends to or receives from; empty once the exchange is over."""
        return self.unread | self.unanswered | set(self.ring_sent)

    @property
    def ring_full(self) -> bool:
        """Whether a message still waits for room in a ring (its reader rings only while a
        message is incomplete, so a full ring is looked at again soon)."""
        return bool(self.ring_sent)

    def step(self) -> bool:
        """Move what can move now; whether anything did."""
        progressed = bool(self.unanswered) and self._answer_wants()
        if self.ring_sent:
            progressed |= self._write_rings()
        if not self.own_copied:
            self._copy_own_share()  # while the peers work on theirs
        if self.unread:
            progressed |= self._receive()
        return progressed

    # As a sender ---------------------------------------------------------------------------

    def _answer_wants(self) -> bool:
        """Write large messages straight into the results whose owners said where."""
        op, key, progressed = self.op, self.key, False
        for d in sorted(self.unanswered):
            want = self.wire.wanted.pop((d, key), None)
            if want is None:
                continue
            if want.nbytes != op.in_bytes[d]:
                raise SplitMismatch(f"rank {d} expects {want.nbytes} bytes but this rank sends {op.in_bytes[d]} "
                                    f"(splits or sizes differ between ranks)")
            self.unanswered.discard(d)
            if want.file_id:
                dst = self.peer_files.address(d, want.file_id, want.fd) + want.offset
                ctypes.memmove(dst, op.send + op.in_offsets[d], want.nbytes)
                self.wire.done(d, key)
            else:
                self.ring_sent[d] = 0  # "use the ring": announced already
            progressed = True
        return progressed

    def _write_rings(self) -> bool:
        """Write what fits of the ring messages; announce or ring the doorbell."""
        op, key, progressed = self.op, self.key, False
        for d in list(self.ring_sent):
            ring = self.outbound[d]
            wrote = pump(ring.can_write, ring.write, op.send + op.in_offsets[d], op.in_bytes[d], self.ring_sent, d,
                         self.chunk)
            if d in self.unannounced:  # the POST doubles as the first chunks' doorbell
                self.wire.post(d, key, False, op.in_bytes[d])
                self.unannounced.discard(d)
            elif wrote:
                self.wire.bell(d, key)
            if self.ring_sent[d] == op.in_bytes[d]:
                del self.ring_sent[d]
            progressed |= wrote
        return progressed

    def _copy_own_share(self) -> None:
        op, me = self.op, self.rank
        if op.in_bytes[me]:
            ctypes.memmove(op.recv + op.out_offsets[me], op.send + op.in_offsets[me], op.in_bytes[me])
        self.own_copied = True

    # As a receiver -------------------------------------------------------------------------

    def _receive(self) -> bool:
        """Take in what has arrived: finished direct writes, ring chunks."""
        op, key, wire, progressed = self.op, self.key, self.wire, False
        for s in sorted(self.unread):
            post = wire.posted.get((s, key))
            if post is None:
                continue
            if post.nbytes != op.out_bytes[s]:
                raise SplitMismatch(f"rank {s} sends {post.nbytes} bytes but this rank expects {op.out_bytes[s]} "
                                    f"(splits or sizes differ between ranks)")
            if s in self.direct:
                if (s, key) in wire.written:
                    wire.written.discard((s, key))
                    self.received[s] = post.nbytes
                    progressed = True
            else:
                ring = self.inbound[s]
                if pump(ring.can_read, ring.read, op.recv + op.out_offsets[s], op.out_bytes[s], self.received, s,
                        self.chunk):
                    if self.received[s] < post.nbytes:  # more to come: the sender may be waiting for room
                        wire.bell(s, key)
                    progressed = True
            if self.received[s] == post.nbytes:
                self.unread.discard(s)
                del wire.posted[(s, key)]
        return progressed
