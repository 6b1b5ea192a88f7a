"""The SM-free transport: collectives staged through host memory and moved by a CPU proxy.

No kernel of ours runs for a transfer. On CUDA a device tensor is copied into a pinned host
buffer with ``cudaMemcpyAsync`` on a dedicated copy stream (``copy_(non_blocking=True)``), the
proxy thread waits for that copy's event, moves the bytes, and the result is copied back on
the copy stream; the consumer's stream waits on an event, never on the host. On CPU the
staging copies disappear and the proxy path runs as is.

Every rank runs one proxy thread. Collectives are queued to it in the order they are issued
(as with any process group) and run one at a time, by the proxy or by a caller that waits for
its collective before the proxy has started it (no hand-off between threads then). Between
ranks on one host the proxies talk over a Unix stream socket per pair of ranks (abstract
namespace: nothing on disk): short control messages, and the end of a peer's connection is
how a dead peer shows. The bytes move one of two ways (``transport.local_path``):

- ``mapped`` (one copy): results of more than 64 KiB live in memory files (``memfd``) that
  the peers map (through ``/proc/<pid>/fd``). For a message of at least one ring chunk the
  receiver tells the sender where in its result the message goes, the sender copies it
  straight there and says so; the receiver's collective ends when every sender has.
  Messages smaller than a chunk go through the rings below: no round trip, which is what
  small messages are bound by.
- ``shm_ring`` (two copies, where peers cannot map each other's memory files): every ordered
  pair (src, dst) has a ring of ``slots`` chunks of ``chunk_bytes`` in a POSIX shared-memory
  segment with a write and a read counter. The proxy of ``src`` copies a chunk in and bumps
  the write counter; the proxy of ``dst`` copies it out and bumps the read counter; either
  rings the other's doorbell (a message on the pair's socket). Large messages pipeline chunk
  by chunk. The counters are written after the data and read before it; this relies on x86's
  ordered stores (TSO). Segments are created by the receiving rank, opened by the sender and
  unlinked as soon as every rank has opened its channels, so nothing is left in ``/dev/shm``
  even when a peer crashes (memory files have no name at all).
- ``auto`` (default) probes at start-up whether every rank can map every peer's memory files
  and takes ``mapped`` if so, ``shm_ring`` otherwise (every rank takes the same).

Ranks on different hosts exchange their splits with gloo point-to-point messages on the
transport's own process group: posted when the collective starts, they progress in gloo's
threads while the proxy moves the local part, and are waited for after it.

Each proxy progresses all its peers at once (no order of peers can deadlock), polls briefly
(``spin_us``) and then sleeps in ``select`` on its sockets. Every sender announces the size of
each message, so splits that disagree between ranks fail with a message saying so. Failure:
a peer whose connection ends, a peer whose process is gone, or no progress for ``timeout_s``
fails the collective: ``wait()`` raises ``TransportError`` naming the operation, the peer and
the cause, and the peers are told. After a failure the peers' state is unknown, so every later
collective on this transport fails at once with the same cause; build a new transport to go on.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import datetime
import itertools
import math
import mmap
import os
import select
import socket
import struct
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import torch
import torch.distributed as dist

from freescale.transport.base import TransportError, register

_libc = ctypes.CDLL(None, use_errno=True)
_HEADER = 128  # ring counters: write at byte 0, read at byte 64 (separate cache lines)
_MSG = struct.Struct("<B3xiqQQQ")  # kind, sender rank, collective number, three fields
# POST (sender -> receiver): "a message of n bytes for you", in the ring (0) or large (1).
# WANT (receiver -> sender, large messages): "write it at (buffer, offset)", or (0) "use the ring".
# DONE (sender -> receiver): "written". BELL: "look at our ring again".
# FAIL: "this collective failed here" (so the peers fail at once instead of at their timeout).
_POST, _WANT, _DONE, _BELL, _FAIL = 1, 2, 3, 4, 5
_CHECK_S = 0.05  # how often a waiting proxy checks that its peers' processes still run
_SMALL = 64 << 10  # results up to this size are allocated, larger ones come from the pool
_GRACE_S = 0.001  # how long the proxy leaves a new collective to a caller that waits for it at once


class _Channel:
    """A ring of ``slots`` chunks between one sender and one receiver."""

    def __init__(self, shm: shared_memory.SharedMemory, chunk: int, slots: int) -> None:
        self.shm = shm
        self.chunk = chunk
        self.slots = slots
        self.counters = np.ndarray((16,), dtype=np.int64, buffer=shm.buf[:_HEADER])
        self.data = np.ndarray((slots * chunk,), dtype=np.uint8, buffer=shm.buf[_HEADER:_HEADER + slots * chunk])
        self.base = self.data.ctypes.data

    @staticmethod
    def size(chunk: int, slots: int) -> int:
        return _HEADER + chunk * slots

    def can_write(self) -> bool:
        return int(self.counters[0]) - int(self.counters[8]) < self.slots

    def write(self, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` (at most a chunk) from address ``src`` into the next free slot."""
        seq = int(self.counters[0])
        ctypes.memmove(self.base + (seq % self.slots) * self.chunk, src, nbytes)
        self.counters[0] = seq + 1

    def can_read(self) -> bool:
        return int(self.counters[0]) > int(self.counters[8])

    def read(self, dst: int, nbytes: int) -> None:
        """Copy ``nbytes`` of the oldest unread slot to address ``dst``."""
        seq = int(self.counters[8])
        ctypes.memmove(dst, self.base + (seq % self.slots) * self.chunk, nbytes)
        self.counters[8] = seq + 1

    def close(self) -> None:
        self.counters = self.data = None
        self.shm.close()


class _Handle:
    """What a collective returns: ``wait()`` runs or awaits it, then gives the result or raises."""

    def __init__(self, op: str, finish, drive) -> None:
        self.op = op
        self.finish = finish
        self.drive = drive
        self.done = threading.Event()
        self.error: BaseException | None = None

    def wait(self) -> torch.Tensor:
        self.drive(self)
        if self.error is not None:
            raise TransportError(f"host_staged {self.op}: {self.error}") from self.error
        return self.finish()


@dataclass
class _Op:
    """One collective as the proxy sees it: addresses, per-peer offsets and lengths in bytes."""

    number: int
    handle: _Handle
    ready: object  # a CUDA event to wait for before reading ``send``, or None
    send: int  # address of the bytes to send (held alive by ``keep``)
    in_offsets: list[int]
    in_bytes: list[int]
    recv: int  # address of the result's bytes
    out_offsets: list[int]
    out_bytes: list[int]
    keep: tuple = field(default=())  # tensors that must live until the collective ends


class _Peer:
    """The control connection to one rank on this host, with its undelivered bytes."""

    def __init__(self, rank: int, sock: socket.socket) -> None:
        self.rank = rank
        self.sock = sock
        self.inbox = bytearray()
        self.gone: str | None = None  # why the connection ended, once it has
        self.failed: int | None = None  # the first collective this peer reported as failed


@register("host_staged")
class HostStagedTransport:
    def __init__(self, group: dist.ProcessGroup | None = None, cfg=None) -> None:
        from freescale.config import TransportConfig

        cfg = cfg or TransportConfig(kind="host_staged")
        self.group = group or dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.chunk = cfg.chunk_kib * 1024
        self.slots = cfg.slots
        self.timeout_s = cfg.timeout_s
        self._spin_s = cfg.spin_us * 1e-6
        self._global = [dist.get_global_rank(self.group, r) for r in range(self.world_size)]

        probe = _memory_file(8)  # what peers map to test that they can: holds this rank's pid
        try:
            os.pwrite(probe, struct.pack("<q", os.getpid()), 0)
            info = [None] * self.world_size
            dist.all_gather_object(info, (os.uname().nodename, os.getpid(), probe), group=self.group)
            host = info[self.rank][0]
            self.pids = [pid for _, pid, _ in info]
            self.local = [h == host for h, _, _ in info]
            token = [uuid.uuid4().hex[:12] if self.rank == 0 else None]
            dist.broadcast_object_list(token, src=self._global[0], group=self.group)
            self.prefix = f"freescale-{token[0]}"
            self.local_path = self._choose_local_path(cfg.local_path, info)
        finally:
            os.close(probe)

        self._peers = self._connect()
        self.inbound: dict[int, _Channel] = {}
        self.outbound: dict[int, _Channel] = {}
        self._open_rings()  # mapped too: messages smaller than a chunk go through the rings

        self._pool: dict[tuple, list[torch.Tensor]] = {}
        self._files: dict[int, tuple[int, int, mmap.mmap]] = {}  # result address -> (id, fd, mapping)
        self._file_ids = itertools.count(1)
        self._peer_files: dict[tuple[int, int], tuple] = {}  # (peer, id) -> (mapping, export, address)
        self._copy_stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self._ops: collections.deque[_Op] = collections.deque()
        self._posted: dict[tuple[int, int], tuple[int, int]] = {}  # (sender, number) -> (large, bytes)
        self._wanted: dict[tuple[int, int], tuple[int, int, int]] = {}  # (receiver, number) -> (file, offset, bytes)
        self._done: set[tuple[int, int]] = set()  # (sender, number) written into this rank's result
        self._numbers = itertools.count()
        self._failed: str | None = None
        self._closed = False
        self._exec = threading.Lock()  # held by whichever thread runs collectives (proxy or a waiter)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._alarm = _Alarm.create(_GRACE_S)  # None where timerfd is missing: the proxy is woken at once
        self._queue_lock = threading.Lock()  # the queue and the alarm change together
        self._proxy = threading.Thread(target=self._serve, name=f"host-staged-proxy-{self.rank}", daemon=True)
        self._proxy.start()
        _LIVE.add(self)

    # Set-up --------------------------------------------------------------------------------

    def _choose_local_path(self, wanted: str, info: list) -> str:
        """``mapped`` if every rank can map its peers' memory files (and ``wanted`` allows it)."""
        local = [r for r in range(self.world_size) if r != self.rank and self.local[r]]
        problem = None
        if wanted != "shm_ring":
            for r in local:
                _, pid, fd = info[r]
                try:
                    mapping = _map_peer_file(pid, fd)
                    got = struct.unpack("<q", mapping[:8])[0]
                    mapping.close()
                except OSError as e:
                    problem = f"rank {self.rank} cannot map rank {r}'s memory: {e.strerror or e}"
                    break
                if got != pid:
                    problem = f"rank {self.rank} mapped the wrong memory of rank {r} (different pid namespaces?)"
                    break
        problems = [None] * self.world_size
        dist.all_gather_object(problems, problem, group=self.group)  # every rank decides alike
        first = next((p for p in problems if p), None)
        if wanted == "mapped" and first:
            raise TransportError(f"host_staged: transport.local_path=mapped but {first}")
        return "shm_ring" if wanted == "shm_ring" or first else "mapped"

    def _connect(self) -> dict[int, _Peer]:
        """One Unix stream socket per pair of ranks on this host; the lower rank connects."""
        local = [r for r in range(self.world_size) if r != self.rank and self.local[r]]
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(f"\0{self.prefix}-{self.rank}")
        listener.listen(max(1, len(local)))
        dist.barrier(group=self.group)
        peers = {}
        for r in local:
            if r > self.rank:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(f"\0{self.prefix}-{r}")
                sock.sendall(struct.pack("<i", self.rank))
                peers[r] = _Peer(r, sock)
        listener.settimeout(self.timeout_s)
        for _ in range(sum(r < self.rank for r in local)):
            sock, _ = listener.accept()
            sock.settimeout(self.timeout_s)
            (r,) = struct.unpack("<i", _recv_exactly(sock, 4))
            peers[r] = _Peer(r, sock)
        listener.close()
        for p in peers.values():
            p.sock.setblocking(False)
        return peers

    def _open_rings(self) -> None:
        # Inbound rings are created here, outbound ones opened once every rank has created.
        size = _Channel.size(self.chunk, self.slots)
        for src in self._peers:
            shm = shared_memory.SharedMemory(name=self._name(src, self.rank), create=True, size=size)
            _untrack(shm)
            shm.buf[:_HEADER] = bytes(_HEADER)
            self.inbound[src] = _Channel(shm, self.chunk, self.slots)
        dist.barrier(group=self.group)
        for dst in self._peers:
            shm = shared_memory.SharedMemory(name=self._name(self.rank, dst), create=False)
            _untrack(shm)
            self.outbound[dst] = _Channel(shm, self.chunk, self.slots)
        dist.barrier(group=self.group)
        for ch in self.inbound.values():
            shared_memory._posixshmem.shm_unlink(ch.shm._name)  # noqa: SLF001  (untracked: see _untrack)

    def _name(self, src: int, dst: int) -> str:
        return f"{self.prefix}-{src}-{dst}"

    # Interface -----------------------------------------------------------------------------

    def all_to_all_single(self, tensor: torch.Tensor, input_splits: list[int], output_splits: list[int]):
        return self._submit("all_to_all_single", tensor, list(input_splits), list(output_splits), gather=False)

    def all_gather(self, tensor: torch.Tensor, sizes: list[int] | None = None):
        sizes = [tensor.shape[0]] * self.world_size if sizes is None else list(sizes)
        if sizes[self.rank] != tensor.shape[0]:
            raise ValueError(f"all_gather: sizes[{self.rank}] is {sizes[self.rank]} but this rank has {tensor.shape[0]} rows")
        return self._submit("all_gather", tensor, [tensor.shape[0]] * self.world_size, sizes, gather=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake()
        self._proxy.join(timeout=5)
        for ch in (*self.inbound.values(), *self.outbound.values()):
            ch.close()
        for p in self._peers.values():
            p.sock.close()
        for _, fd, _ in self._files.values():
            os.close(fd)  # the memory lives on while results or peers still map it
        self._files.clear()
        self._peer_files.clear()
        self._wake_r.close()
        self._wake_w.close()
        if self._alarm is not None:
            self._alarm.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # Staging -------------------------------------------------------------------------------

    def _submit(self, op: str, tensor: torch.Tensor, input_splits, output_splits, gather: bool):
        if len(input_splits) != self.world_size or len(output_splits) != self.world_size:
            raise ValueError(f"{op}: expected {self.world_size} splits, got {len(input_splits)} and {len(output_splits)}")
        if self._closed:
            raise TransportError(f"host_staged {op}: the transport is closed")
        tensor = tensor.contiguous()
        row_shape = tuple(tensor.shape[1:])
        row_bytes = tensor.element_size() * math.prod(row_shape)
        out_host = self._buffer((sum(output_splits), *row_shape), tensor.dtype, pinned=tensor.is_cuda)
        ready = None
        if tensor.is_cuda:
            src = self._buffer(tuple(tensor.shape), tensor.dtype, pinned=True)
            ready = torch.cuda.Event()
            self._copy_stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(self._copy_stream):
                src.copy_(tensor, non_blocking=True)
                ready.record(self._copy_stream)
        else:
            src = tensor

        def finish() -> torch.Tensor:
            if not tensor.is_cuda:
                return out_host
            with torch.cuda.stream(self._copy_stream):
                out = out_host.to(tensor.device, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._copy_stream)
            torch.cuda.current_stream(tensor.device).wait_event(done)
            out.record_stream(torch.cuda.current_stream(tensor.device))
            return out

        in_bytes = [n * row_bytes for n in input_splits]
        out_bytes = [n * row_bytes for n in output_splits]
        item = _Op(
            number=next(self._numbers), handle=_Handle(op, finish, self._drive), ready=ready,
            send=src.data_ptr(), in_bytes=in_bytes,
            # Every destination of an all-gather reads the same bytes: its offsets all start at 0.
            in_offsets=[0] * self.world_size if gather else [0, *itertools.accumulate(in_bytes)][:-1],
            recv=out_host.data_ptr(), out_bytes=out_bytes, out_offsets=[0, *itertools.accumulate(out_bytes)][:-1],
            keep=(tensor, src, out_host))
        with self._queue_lock:
            self._ops.append(item)
            if self._alarm is not None:
                self._alarm.arm()
        if self._alarm is None:
            self._wake()
        return item.handle

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # a wake-up is already pending (or the transport is closing)

    def _buffer(self, shape: tuple, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        """A host tensor from a pool of buffers nobody references any more (results, staging).

        Fresh large allocations come from the kernel page by page on first touch; reusing a
        buffer whose storage no tensor holds avoids that on every call. Small host buffers come
        from the allocator directly (cheaper than a pool lookup).
        """
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes <= _SMALL and not pinned:
            return torch.empty(shape, dtype=dtype)
        size = 1 << max(12, (max(nbytes, 1) - 1).bit_length())  # power-of-two classes from 4 KiB
        pool = self._pool.setdefault((size, pinned), [])
        for buf in pool:
            if _only_pool_holds(buf):
                break
        else:
            if len(pool) < 4 and not pinned and self.local_path == "mapped":
                buf = self._mapped_buffer(size)  # peers write results straight into it
            else:
                buf = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
            if len(pool) < 4:
                pool.append(buf)
        return buf[:nbytes].view(dtype).view(shape)

    def _mapped_buffer(self, size: int) -> torch.Tensor:
        fd = _memory_file(size)
        mapping = mmap.mmap(fd, size)
        buf = torch.frombuffer(mapping, dtype=torch.uint8)
        self._files[buf.data_ptr()] = (next(self._file_ids), fd, mapping)
        return buf

    def _peer_address(self, peer: int, file: int, fd: int) -> int:
        """Where ``peer``'s memory file ``file`` is mapped here (mapped once, then reused)."""
        hit = self._peer_files.get((peer, file))
        if hit is None:
            mapping = _map_peer_file(self.pids[peer], fd)
            export = ctypes.c_char.from_buffer(mapping)
            hit = self._peer_files[(peer, file)] = (mapping, export, ctypes.addressof(export))
        return hit[2]

    # The proxy -----------------------------------------------------------------------------

    def _serve(self) -> None:
        """Take over collectives that nobody has started ``_GRACE_S`` after they were issued.

        A caller that waits at once runs its collective itself (``_drive``): no hand-off
        between threads, and the proxy wakes only later, to find nothing left. A caller that
        computes in between gets its collective moved by the proxy meanwhile.
        """
        waits = [self._wake_r] if self._alarm is None else [self._wake_r, self._alarm]
        while not self._closed:
            select.select(waits, [], [])
            try:
                self._wake_r.recv(4096)
            except (BlockingIOError, OSError):
                pass
            if self._alarm is None:
                time.sleep(_GRACE_S)
            else:
                with self._queue_lock:
                    self._alarm.take()
            self._run_queued()
        for item in self._ops:
            item.handle.error = RuntimeError("the transport was closed")
            item.handle.done.set()

    def _drive(self, handle: _Handle) -> None:
        """Wait for ``handle``, running the queued collectives up to it here if the proxy is idle.

        A caller that waits right after issuing then pays no hand-off to the proxy thread; one
        that computes in between finds its collective already done (or under way) by the proxy.
        """
        while not handle.done.is_set():
            self._run_queued(until=handle)
            handle.done.wait(0.01)
        # The alarm is left to fire: one idle wake-up of the proxy costs less than disarming
        # after every collective (a timer system call each).

    def _run_queued(self, until: _Handle | None = None) -> None:
        """Run queued collectives (up to ``until``'s) unless another thread is running them."""
        if not self._exec.acquire(blocking=False):
            return  # that thread hands over (below) when it stops with collectives left
        try:
            while self._ops and not self._closed and not (until and until.done.is_set()):
                self._run_next()
        finally:
            self._exec.release()
        if self._ops and until is not None:
            self._wake()  # later collectives: the proxy takes them

    def _run_next(self) -> None:
        """Run the oldest queued collective (the caller holds ``_exec``)."""
        item = self._ops.popleft()
        try:
            if self._failed:
                raise RuntimeError(f"an earlier collective failed: {self._failed}")
            self._run(item)
        except BaseException as e:  # delivered to wait(); later collectives fail the same way
            self._failed = self._failed or str(e)
            item.handle.error = e
            for peer in self._peers.values():
                try:
                    self._send(peer, _FAIL, item.number, timeout_s=0.1)
                except RuntimeError:
                    pass  # that peer is gone too
        item.handle.done.set()

    def _run(self, op: _Op) -> None:
        """Move one collective's bytes: own share, peers on this host, peers on other hosts.

        Towards a peer on this host, a message smaller than a ring chunk (every message, with
        ``shm_ring``) is written into the pair's ring and announced with a POST; the sender is
        done once it is written. A larger one is announced too, the receiver answers with
        where in its result it goes (WANT), the sender copies it there and says DONE: one
        copy instead of two. A receiver whose result is not a memory file (a pinned staging
        buffer, or a pool that is all in use) answers "use the ring" instead.
        """
        if op.ready is not None:
            op.ready.synchronize()
        me, number = self.rank, op.number
        remote = self._start_remote(op)
        mapped = self.local_path == "mapped"
        # As a receiver: say where large messages go, at once (it saves the senders a round trip).
        file = self._files.get(op.recv) if mapped else None
        awaiting = set()  # peers that write straight into the result
        for s, peer in self._peers.items():
            if mapped and op.out_bytes[s] >= self.chunk:
                if file is not None:
                    self._send(peer, _WANT, number, file[0] << 32 | file[1], op.out_offsets[s], op.out_bytes[s])
                    awaiting.add(s)
                else:
                    self._send(peer, _WANT, number, 0, 0, op.out_bytes[s])
        # As a sender: large messages wait for their receiver's WANT, small ones go now.
        large = set()
        to_ring = {}  # peer -> bytes written into its ring so far
        for d, peer in self._peers.items():
            if mapped and op.in_bytes[d] >= self.chunk:
                self._send(peer, _POST, number, 1, 0, op.in_bytes[d])
                large.add(d)
            else:
                to_ring[d] = 0
        unposted = set(to_ring)
        unread = set(self._peers)
        got = dict.fromkeys(self._peers, 0)  # peer -> bytes of its message in the result so far
        own_copied = False
        deadline = time.monotonic() + self.timeout_s
        next_check = time.monotonic() + _CHECK_S
        while True:
            progressed = False
            for d in sorted(large):
                want = self._wanted.pop((d, number), None)
                if want is None:
                    continue
                where, offset, nbytes = want
                if nbytes != op.in_bytes[d]:
                    raise RuntimeError(f"rank {d} expects {nbytes} bytes but this rank sends {op.in_bytes[d]} "
                                       f"(splits or sizes differ between ranks)")
                large.discard(d)
                if where:
                    dst = self._peer_address(d, where >> 32, where & 0xFFFFFFFF) + offset
                    ctypes.memmove(dst, op.send + op.in_offsets[d], nbytes)
                    self._send(self._peers[d], _DONE, number)
                else:
                    to_ring[d] = 0  # announced already
                progressed = True
            for d in list(to_ring):
                wrote = self._ring_write(op, d, to_ring)
                if d in unposted:  # the POST doubles as the first chunks' doorbell
                    self._send(self._peers[d], _POST, number, 0, 0, op.in_bytes[d])
                    unposted.discard(d)
                elif wrote:
                    self._send(self._peers[d], _BELL, number)
                if to_ring[d] == op.in_bytes[d]:
                    del to_ring[d]
                progressed |= wrote
            if not own_copied:
                # This rank's own share, copied while the peers work on theirs.
                if op.in_bytes[me]:
                    ctypes.memmove(op.recv + op.out_offsets[me], op.send + op.in_offsets[me], op.in_bytes[me])
                own_copied = True
            for s in sorted(unread):
                post = self._posted.get((s, number))
                if post is None:
                    continue
                nbytes = post[1]
                if nbytes != op.out_bytes[s]:
                    raise RuntimeError(f"rank {s} sends {nbytes} bytes but this rank expects {op.out_bytes[s]} "
                                       f"(splits or sizes differ between ranks)")
                if s in awaiting:
                    if (s, number) in self._done:
                        self._done.discard((s, number))
                        got[s] = nbytes
                        progressed = True
                elif self._ring_read(op, s, got):
                    if got[s] < nbytes:  # more to come: the sender may be waiting for room
                        self._send(self._peers[s], _BELL, number)
                    progressed = True
                if got[s] == nbytes:
                    unread.discard(s)
                    del self._posted[(s, number)]
            waiting = unread | large | set(to_ring)
            if not waiting:
                self._finish_remote(remote)
                return
            now = time.monotonic()
            if progressed:
                deadline = now + self.timeout_s
            elif now >= deadline:
                raise RuntimeError(f"no progress for {self.timeout_s:g} s waiting for rank(s) "
                                   f"{sorted(waiting) or ['on other hosts']}")
            self._check_peers(sorted(waiting), number, pids=now >= next_check)
            if now >= next_check:
                next_check = now + _CHECK_S
            if not progressed:
                # Nothing to do until a peer says something (a full ring is looked at every
                # millisecond: its reader rings only while a message is incomplete).
                self._wait(0.001 if to_ring else min(_CHECK_S, max(0.0, deadline - now)))

    def _check_peers(self, ranks: list[int], number: int, pids: bool) -> None:
        """Fail if a peer this collective waits for has failed it, closed its end or exited."""
        for r in ranks:
            p = self._peers[r]
            if p.failed is not None and p.failed <= number:
                which = "this" if p.failed == number else "an earlier"
                raise RuntimeError(f"rank {r} failed {which} collective (its own error says why)")
            if p.gone:
                if _exits_within(self.pids[r], 0.2):
                    raise RuntimeError(f"peer rank {r} (pid {self.pids[r]}) died ({p.gone})")
                raise RuntimeError(f"peer rank {r} (pid {self.pids[r]}) closed its transport")
            if pids and not _alive(self.pids[r]):
                raise RuntimeError(f"peer rank {r} (pid {self.pids[r]}) died")

    def _ring_write(self, op: _Op, dst: int, sent: dict) -> bool:
        """Write what fits of this rank's message to ``dst`` into their ring."""
        ch = self.outbound[dst]
        return _pump(ch.can_write, ch.write, op.send + op.in_offsets[dst], op.in_bytes[dst], sent, dst, self.chunk)

    def _ring_read(self, op: _Op, src: int, got: dict) -> bool:
        """Read what has arrived of ``src``'s message from their ring."""
        ch = self.inbound[src]
        return _pump(ch.can_read, ch.read, op.recv + op.out_offsets[src], op.out_bytes[src], got, src, self.chunk)

    def _send(self, peer: _Peer, kind: int, number: int, a: int = 0, b: int = 0, c: int = 0,
              timeout_s: float | None = None) -> None:
        data = memoryview(_MSG.pack(kind, self.rank, number, a, b, c))
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while data:
            try:
                n = peer.sock.send(data)
                data = data[n:]
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"rank {peer.rank} stopped taking messages for {self.timeout_s:g} s") from None
                select.select([], [peer.sock], [], _CHECK_S)
            except OSError as e:
                # Say why the peer is gone: it reported a failure before closing, or it exited.
                until = time.monotonic() + 0.5
                while peer.gone is None and time.monotonic() < until:
                    select.select([peer.sock], [], [], 0.05)
                    self._take(peer)
                self._check_peers([peer.rank], number, pids=True)
                raise RuntimeError(f"peer rank {peer.rank} (pid {self.pids[peer.rank]}) is gone ({e.strerror})") from e

    def _wait(self, timeout: float) -> None:
        """Sleep until a peer's message (or ``timeout``) and file the messages.

        Polls for ``spin_us`` first: waking a sleeping thread costs tens of microseconds or
        more, the order of a whole small collective.
        """
        socks = [p.sock for p in self._peers.values() if not p.gone]
        readable, _, _ = select.select(socks, [], [], 0)
        if not readable and self._spin_s:
            until = time.perf_counter() + min(self._spin_s, timeout)
            while not readable and time.perf_counter() < until:
                os.sched_yield()
                readable, _, _ = select.select(socks, [], [], 0)
        if not readable:
            readable, _, _ = select.select(socks, [], [], timeout)
        for sock in readable:
            self._take(next(p for p in self._peers.values() if p.sock is sock))

    def _take(self, peer: _Peer) -> None:
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
        whole = len(peer.inbox) - len(peer.inbox) % _MSG.size
        for kind, sender, number, a, b, c in _MSG.iter_unpack(bytes(peer.inbox[:whole])):
            if kind == _POST:
                self._posted[(sender, number)] = (a, c)
            elif kind == _WANT:
                self._wanted[(sender, number)] = (a, b, c)
            elif kind == _DONE:
                self._done.add((sender, number))
            elif kind == _FAIL and peer.failed is None:
                peer.failed = number
        del peer.inbox[:whole]

    def _finish_remote(self, works: list) -> None:
        """Wait for the point-to-point transfers with other hosts (posted at the start, they
        progress in gloo's own threads meanwhile; gloo tells completion only through wait)."""
        for w in works:
            try:
                w.wait(datetime.timedelta(seconds=self.timeout_s))
            except RuntimeError as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise RuntimeError(f"a transfer with another host failed: {first}") from e

    def _start_remote(self, op: _Op) -> list:
        """Gloo point-to-point for peers on other hosts."""
        works = []
        for peer in range(self.world_size):
            if peer == self.rank or self.local[peer]:
                continue
            if op.in_bytes[peer]:
                start = op.in_offsets[peer]
                chunk = torch.from_numpy(_view(op.send + start, op.in_bytes[peer]))
                works.append(dist.isend(chunk, self._global[peer], group=self.group))
            if op.out_bytes[peer]:
                start = op.out_offsets[peer]
                chunk = torch.from_numpy(_view(op.recv + start, op.out_bytes[peer]))
                works.append(dist.irecv(chunk, self._global[peer], group=self.group))
        return works


def _pump(ready, move, address: int, total: int, done: dict, key: int, chunk: int) -> bool:
    """Move chunks of the ``total`` bytes at ``address`` (``done[key]`` moved so far) while the
    ring is ``ready()``; whether any moved."""
    moved = False
    while done[key] < total and ready():
        n = min(chunk, total - done[key])
        move(address + done[key], n)
        done[key] += n
        moved = True
    return moved


def _view(address: int, nbytes: int) -> np.ndarray:
    """The ``nbytes`` bytes at ``address`` as a numpy array (no copy; the owner keeps them alive)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address)) if nbytes else np.zeros(0, np.uint8)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        more = sock.recv(n - len(data))
        if not more:
            raise TransportError("host_staged: a peer closed its connection while connecting")
        data += more
    return data


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("interval", _Timespec), ("value", _Timespec)]


class _Alarm:
    """A one-shot ``timerfd``: readable ``seconds`` after ``arm``.

    Arming is one system call and wakes nobody; while armed, ``arm`` does nothing (so a stream
    of collectives arms it once, not once each).
    """

    def __init__(self, fd: int, seconds: float) -> None:
        self.fd = fd
        self.armed = False
        value = _Timespec(int(seconds), int((seconds % 1) * 1e9))
        self._spec = ctypes.byref(_Itimerspec(_Timespec(0, 0), value))  # built once: arming stays cheap

    @classmethod
    def create(cls, seconds: float) -> "_Alarm | None":
        create = getattr(_libc, "timerfd_create", None)
        if create is None:
            return None
        fd = create(1, os.O_NONBLOCK | os.O_CLOEXEC)  # CLOCK_MONOTONIC; TFD_* equal the O_* flags
        return cls(fd, seconds) if fd >= 0 else None

    def fileno(self) -> int:
        return self.fd

    def arm(self) -> None:
        if not self.armed:
            _timerfd_settime(self.fd, 0, self._spec, None)
            self.armed = True

    def take(self) -> None:
        """Consume a fired alarm (its file descriptor stays readable until then)."""
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            pass
        self.armed = False

    def close(self) -> None:
        os.close(self.fd)


_timerfd_settime = getattr(_libc, "timerfd_settime", None)


def _memory_file(size: int) -> int:
    """An anonymous memory file of ``size`` bytes (no name anywhere: gone with its last user)."""
    fd = os.memfd_create("freescale-host-staged", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return fd


def _map_peer_file(pid: int, fd: int) -> mmap.mmap:
    """Map another process's memory file (its descriptor ``fd``) here, shared and writable."""
    f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
    try:
        return mmap.mmap(f, os.fstat(f).st_size)
    finally:
        os.close(f)


_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Stop the proxies before the interpreter tears down (a proxy left running then can abort it)."""
    for t in list(_LIVE):
        t.close()


_use_count = getattr(torch._C, "_storage_Use_Count", None)  # noqa: SLF001


def _only_pool_holds(buf: torch.Tensor) -> bool:
    """No tensor but the pool's own references ``buf``'s storage (2: the pool's tensor and the
    temporary storage object). Without the counter (other torch builds) nothing is reused."""
    return _use_count is not None and _use_count(buf.untyped_storage()._cdata) == 2  # noqa: SLF001


def _alive(pid: int) -> bool:
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


def _exits_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` is gone now or within ``seconds`` (one whose connections just
    ended may still be exiting)."""
    deadline = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def _untrack(shm: shared_memory.SharedMemory) -> None:
    """Keep Python's resource tracker out: creating and opening a segment both register it (and
    ranks spawned from one parent share a tracker), while the lifetime here is explicit."""
    try:
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
    except Exception:
        pass
