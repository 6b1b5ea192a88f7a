"""The control wire between the ranks of one host: message kinds, peers, liveness.

One Unix stream socket per pair of ranks, in the abstract namespace (nothing on disk); the
lower rank connects. Control messages are fixed-size records; the bytes of a collective go
through shared memory (``memory``), never through the socket. The end of a peer's
connection is how a dead or closed peer shows, and ``/proc/<pid>`` tells the two apart.

A collective is named on the wire by its ``OpKey`` (lane, sequence): collectives of one lane
run in the order they were issued, the same on every rank; lanes let a later collective of
another lane pass.

Messages, each with its sender and key:

- ``Post(large, nbytes)``, sender -> receiver: "a message of ``nbytes`` for you", in the
  pair's ring (large=False, and the POST doubles as the first chunks' doorbell), or written
  straight into your result once you say where (large=True);
- ``Want(file_id, fd, offset, nbytes)``, receiver -> sender, for a large message: "write it
  at ``offset`` of my memory file ``file_id`` (my descriptor ``fd``)", or, with file_id 0,
  "use the ring";
- ``Done``, sender -> receiver: "written";
- ``Bell``: "look at our ring again" (the other side moved a chunk);
- ``Fail``: "this collective failed here", so peers fail at once instead of at their timeout.
"""

from __future__ import annotations

import enum
import os
import select
import socket
import struct
import time
from typing import NamedTuple

from freescale.transport.base import TransportError

_RECORD = struct.Struct("<BBxxiqQQQ")  # kind, lane, sender rank, sequence, three kind-specific fields
CHECK_S = 0.05  # how often a waiting rank checks that its peers' processes still run


class Kind(enum.IntEnum):
    POST = 1
    WANT = 2
    DONE = 3
    BELL = 4
    FAIL = 5


_POST, _WANT, _DONE, _BELL, _FAIL = (Kind.POST.value, Kind.WANT.value, Kind.DONE.value, Kind.BELL.value,
                                     Kind.FAIL.value)  # plain ints on the hot path


class OpKey(NamedTuple):
    """A collective's name on the wire: its lane and its sequence number within the lane."""

    lane: int
    seq: int


class Post(NamedTuple):
    large: bool
    nbytes: int


class Want(NamedTuple):
    file_id: int  # 0: "use the ring"
    fd: int
    offset: int
    nbytes: int


class PeerError(RuntimeError):
    """A peer failed, left or went silent; the message names it and why."""


class Peer:
    """The control connection to one rank on this host, with its undelivered bytes."""

    def __init__(self, rank: int, pid: int, sock: socket.socket) -> None:
        self.rank = rank
        self.pid = pid
        self.sock = sock
        self.inbox = bytearray()
        self.gone: str | None = None  # why the connection ended, once it has
        self.failed: OpKey | None = None  # the first collective this peer reported as failed


class Wire:
    """This rank's control connections, and what its peers have said, filed by collective.

    ``posted[(sender, key)]`` (a ``Post``), ``wanted[(receiver, key)]`` (a ``Want``) and
    ``written`` (``(sender, key)`` pairs that said DONE) are read and cleared by the exchange
    of that collective. ``interrupt()`` (any thread) makes every ``wait`` return at once from
    then on: an aborted transport stops waiting.
    """

    def __init__(self, rank: int, peers: dict[int, Peer], *, timeout_s: float, spin_s: float) -> None:
        self.rank = rank
        self.peers = peers
        self.timeout_s = timeout_s
        self.spin_s = spin_s
        self.posted: dict[tuple[int, OpKey], Post] = {}
        self.wanted: dict[tuple[int, OpKey], Want] = {}
        self.written: set[tuple[int, OpKey]] = set()
        self._interrupt_r, self._interrupt_w = socket.socketpair()
        self._interrupt_r.setblocking(False)
        self._nudge_r, self._nudge_w = socket.socketpair()  # wakes a waiter once (drained on wake-up)
        self._nudge_r.setblocking(False)
        self._nudge_w.setblocking(False)
        self._by_socket = {p.sock: p for p in peers.values()}

    # Sending -------------------------------------------------------------------------------

    def post(self, to: int, key: OpKey, large: bool, nbytes: int) -> None:
        self._send(to, _POST, key, int(large), 0, nbytes)

    def want(self, to: int, key: OpKey, file_id: int, fd: int, offset: int, nbytes: int) -> None:
        self._send(to, _WANT, key, file_id << 32 | fd, offset, nbytes)

    def done(self, to: int, key: OpKey) -> None:
        self._send(to, _DONE, key)

    def bell(self, to: int, key: OpKey) -> None:
        self._send(to, _BELL, key)

    def fail(self, key: OpKey) -> None:
        """Tell every peer still connected that collective ``key`` failed here (best effort)."""
        for peer in self.peers.values():
            if peer.gone is None:
                try:
                    self._send(peer.rank, _FAIL, key, timeout_s=0.1)
                except (PeerError, OSError):
                    pass  # that peer is gone too

    def _send(self, to: int, kind: int, key: OpKey, f1: int = 0, f2: int = 0, f3: int = 0,
              timeout_s: float | None = None) -> None:
        peer = self.peers[to]
        lane, seq = key
        data = memoryview(_RECORD.pack(kind, lane, self.rank, seq, f1, f2, f3))
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while data:
            try:
                n = peer.sock.send(data)
                data = data[n:]
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise PeerError(f"rank {to} stopped taking messages for "
                                    f"{self.timeout_s if timeout_s is None else timeout_s:g} s") from None
                select.select([self._interrupt_r], [peer.sock], [], CHECK_S)
            except OSError as e:
                # Say why the peer is gone: it reported a failure before closing, or it exited.
                until = time.monotonic() + 0.5
                while peer.gone is None and time.monotonic() < until:
                    select.select([peer.sock], [], [], 0.05)
                    self._receive(peer)
                self.check([to], key, pids=True)
                raise PeerError(f"peer rank {to} (pid {peer.pid}) is gone ({e.strerror})") from e

    # Receiving -----------------------------------------------------------------------------

    def wait(self, timeout: float, spin: bool = True) -> None:
        """Sleep until a peer says something (or ``timeout``), and file what it said.

        Polls for ``spin_s`` first (unless ``spin`` is False: a caller that waits for something
        other than a peer): waking a sleeping thread costs tens of microseconds or more, the
        order of a whole small collective. ``timeout`` 0 files what has arrived without waiting.
        """
        socks = [p.sock for p in self.peers.values() if not p.gone]
        socks += [self._interrupt_r, self._nudge_r]
        readable, _, _ = select.select(socks, [], [], 0)
        if not readable and spin and self.spin_s and timeout > 0:
            until = time.perf_counter() + min(self.spin_s, timeout)
            while not readable and time.perf_counter() < until:
                os.sched_yield()
                readable, _, _ = select.select(socks, [], [], 0)
        if not readable and timeout > 0:
            readable, _, _ = select.select(socks, [], [], timeout)
        for sock in readable:
            peer = self._by_socket.get(sock)
            if peer is not None:
                self._receive(peer)
            elif sock is self._nudge_r:
                try:
                    self._nudge_r.recv(4096)
                except BlockingIOError:
                    pass

    def _receive(self, peer: Peer) -> None:
        """File what ``peer`` has sent: announcements and answers by collective, failures."""
        try:
            data = peer.sock.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError as e:
            data, error = b"", e.strerror
        else:
            error = "its connection closed"
        if not data:
            peer.gone = peer.gone or error  # fails the collectives that wait for it
            return
        peer.inbox += data
        whole = len(peer.inbox) - len(peer.inbox) % _RECORD.size
        for kind, lane, sender, seq, f1, f2, f3 in _RECORD.iter_unpack(bytes(peer.inbox[:whole])):
            key = (lane, seq)  # equal to, and hashed as, OpKey(lane, seq)
            if kind == _POST:
                self.posted[(sender, key)] = Post(bool(f1), f3)
            elif kind == _WANT:
                self.wanted[(sender, key)] = Want(f1 >> 32, f1 & 0xFFFFFFFF, f2, f3)
            elif kind == _DONE:
                self.written.add((sender, key))
            elif kind == _FAIL and peer.failed is None:
                peer.failed = OpKey(lane, seq)
        del peer.inbox[:whole]

    # Liveness ------------------------------------------------------------------------------

    def check(self, ranks, key: OpKey, pids: bool) -> None:
        """Raise ``PeerError`` if a peer in ``ranks`` failed collective ``key`` (or one before
        it), closed its end, or exited (``pids``: also look at its process)."""
        self.check_reports(ranks, key)
        for r in ranks:
            p = self.peers[r]
            if p.gone:
                if exits_within(p.pid, 0.2):
                    raise PeerError(f"peer rank {r} (pid {p.pid}) died ({p.gone})")
                raise PeerError(f"peer rank {r} (pid {p.pid}) closed its transport")
            if pids and not alive(p.pid):
                raise PeerError(f"peer rank {r} (pid {p.pid}) died")

    def check_reports(self, ranks, key: OpKey) -> None:
        """Raise ``PeerError`` if a peer in ``ranks`` reported collective ``key`` (or one before
        it) as failed."""
        for r in ranks:
            failed = self.peers[r].failed
            if failed is not None and (failed.lane != key.lane or failed.seq <= key.seq):
                which = "this" if failed == key else "an earlier"
                raise PeerError(f"rank {r} failed {which} collective (its own error says why)")

    def nudge(self) -> None:
        """Wake a waiter once (a collective that may be passed has been issued)."""
        try:
            self._nudge_w.send(b"\0")
        except OSError:
            pass  # a nudge is already pending (or the wire is closed)

    def interrupt(self) -> None:
        try:
            self._interrupt_w.send(b"\0")
        except OSError:
            pass  # already interrupted (buffer full) or closed

    def close(self) -> None:
        for p in self.peers.values():
            p.sock.close()
        for sock in (self._interrupt_r, self._interrupt_w, self._nudge_r, self._nudge_w):
            sock.close()


def listen(prefix: str, rank: int, backlog: int) -> socket.socket:
    """This rank's listening socket (abstract namespace: ``\\0<prefix>-<rank>``)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(f"\0{prefix}-{rank}")
        listener.listen(max(1, backlog))
    except BaseException:
        listener.close()
        raise
    return listener


def connect(listener: socket.socket, prefix: str, rank: int, peers: dict[int, int], timeout_s: float
            ) -> dict[int, Peer]:
    """One connection per pair of ranks on this host (``peers``: rank -> pid), once every rank
    listens: the lower rank connects, the higher accepts. Closes ``listener``.

    Raises ``TransportError`` naming the peer and the cause (a peer that never connects
    within ``timeout_s``, a refused connection).
    """
    connected: dict[int, Peer] = {}
    try:
        for r in sorted(peers):
            if r > rank:
                try:
                    sock = dial(f"\0{prefix}-{r}", timeout_s)
                    sock.sendall(struct.pack("<i", rank))
                except OSError as e:
                    raise TransportError(f"cannot connect to rank {r}: {e.strerror or e}") from e
                connected[r] = Peer(r, peers[r], sock)
        listener.settimeout(timeout_s)
        for _ in range(sum(r < rank for r in peers)):
            try:
                sock, _ = listener.accept()
                sock.settimeout(timeout_s)
                (r,) = struct.unpack("<i", _recv_exactly(sock, 4))
            except socket.timeout:
                waiting = sorted(r for r in peers if r < rank and r not in connected)
                raise TransportError(f"no connection from rank(s) {waiting} within {timeout_s:g} s") from None
            except OSError as e:
                raise TransportError(f"accepting a peer's connection failed: {e.strerror or e}") from e
            connected[r] = Peer(r, peers[r], sock)
    except BaseException:
        for p in connected.values():
            p.sock.close()
        raise
    finally:
        listener.close()
    for p in connected.values():
        p.sock.setblocking(False)
    return connected


def dial(address: str, timeout_s: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(address)
    except BaseException:
        sock.close()
        raise
    return sock


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        more = sock.recv(n - len(data))
        if not more:
            raise TransportError("a peer closed its connection while connecting")
        data += more
    return data


def alive(pid: int) -> bool:
    """Whether a process on this host still runs (an exited, unreaped one counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def exits_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` is gone now or within ``seconds`` (one whose connections just
    ended may still be exiting)."""
    deadline = time.monotonic() + seconds
    while alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True
