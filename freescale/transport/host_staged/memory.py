"""Shared memory between the ranks of one host: rings, memory files, the result pool.

- ``Ring``: ``slots`` chunks of ``chunk`` bytes between one sender and one receiver, in a
  POSIX shared-memory segment with a write and a read counter. The sender copies a chunk in
  and bumps the write counter; the receiver copies it out and bumps the read counter. The
  counters are written after the data and read before it; this relies on x86's ordered
  stores (TSO). Segments are created by the receiving rank, opened by the sender and
  unlinked as soon as every rank has opened its rings, so nothing is left in ``/dev/shm``
  even when a peer crashes.
- Memory files (``memfd``): anonymous memory that another process on the host maps through
  ``/proc/<pid>/fd/<fd>`` (no name anywhere: gone with its last user). ``can_map`` is the
  start-up probe of whether a peer may do so (same user, ``/proc`` readable, one pid
  namespace).
- ``BufferPool``: results and staging buffers from power-of-two size classes, handed out
  again once no tensor holds them; with the ``mapped`` path the first ones of each class are
  memory files, so peers write messages straight into this rank's result.
- ``PeerFiles``: the peers' memory files mapped here once each, by (peer, file id).
"""

from __future__ import annotations

import ctypes
import itertools
import math
import mmap
import os
import struct
from multiprocessing import resource_tracker, shared_memory
from typing import Callable

import numpy as np
import torch

_HEADER = 128  # ring counters: write at byte 0, read at byte 64 (separate cache lines)
_SMALL = 64 << 10  # results up to this size are allocated, larger ones come from the pool
_POOL_CLASS = 4  # buffers kept per size class


class Ring:
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


def pump(ready: Callable[[], bool], move: Callable[[int, int], None], address: int, total: int, moved: dict,
         key: int, chunk: int) -> bool:
    """Move chunks of the ``total`` bytes at ``address`` (``moved[key]`` of them moved so far)
    while the ring is ``ready()``; whether any moved."""
    progressed = False
    while moved[key] < total and ready():
        n = min(chunk, total - moved[key])
        move(address + moved[key], n)
        moved[key] += n
        progressed = True
    return progressed


def create_ring(name: str, chunk: int, slots: int) -> Ring:
    """A new ring in a shared-memory segment ``name`` (created by its receiver)."""
    shm = shared_memory.SharedMemory(name=name, create=True, size=Ring.size(chunk, slots))
    _untrack(shm)
    shm.buf[:_HEADER] = bytes(_HEADER)
    return Ring(shm, chunk, slots)


def open_ring(name: str, chunk: int, slots: int) -> Ring:
    """The ring its receiver created as ``name`` (opened by its sender)."""
    shm = shared_memory.SharedMemory(name=name, create=False)
    _untrack(shm)
    return Ring(shm, chunk, slots)


def unlink(ring: Ring) -> None:
    """Remove a ring's name once both ends have it open: nothing is left in /dev/shm, even after a crash."""
    shared_memory._posixshmem.shm_unlink(ring.shm._name)  # noqa: SLF001  (untracked: see _untrack)


def _untrack(shm: shared_memory.SharedMemory) -> None:
    """Keep Python's resource tracker out: creating and opening a segment both register it (and
    ranks spawned from one parent share a tracker), while the lifetime here is explicit."""
    try:
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
    except Exception:
        pass


# Memory files ------------------------------------------------------------------------------


def memory_file(size: int) -> int:
    """An anonymous memory file of ``size`` bytes (no name anywhere: gone with its last user)."""
    fd = os.memfd_create("freescale-host-staged", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return fd


def map_peer_file(pid: int, fd: int) -> mmap.mmap:
    """Map another process's memory file (its descriptor ``fd``) here, shared and writable."""
    f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
    try:
        return mmap.mmap(f, os.fstat(f).st_size)
    finally:
        os.close(f)


def probe_file() -> int:
    """A memory file holding this process's pid: what peers map at start-up to test that they can."""
    fd = memory_file(8)
    os.pwrite(fd, struct.pack("<q", os.getpid()), 0)
    return fd


def can_map(rank: int, peer: int, pid: int, fd: int) -> str | None:
    """None if this rank can map ``peer``'s probe file, else the problem in one line."""
    try:
        mapping = map_peer_file(pid, fd)
        got = struct.unpack("<q", mapping[:8])[0]
        mapping.close()
    except OSError as e:
        return f"rank {rank} cannot map rank {peer}'s memory: {e.strerror or e}"
    if got != pid:
        return f"rank {rank} mapped the wrong memory of rank {peer} (different pid namespaces?)"
    return None


class PeerFiles:
    """Peers' memory files, mapped here on first use and kept (a peer reuses its results)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self._mapped: dict[tuple[int, int], tuple] = {}  # (peer, file id) -> (mapping, export, address)

    def address(self, peer: int, file_id: int, fd: int) -> int:
        """Where ``peer``'s memory file ``file_id`` (its descriptor ``fd``) starts here."""
        hit = self._mapped.get((peer, file_id))
        if hit is None:
            mapping = map_peer_file(self.pids[peer], fd)
            export = ctypes.c_char.from_buffer(mapping)
            hit = self._mapped[(peer, file_id)] = (mapping, export, ctypes.addressof(export))
        return hit[2]

    def peers(self) -> set[int]:
        """The peers whose files are mapped here."""
        return {peer for peer, _ in self._mapped}

    def close(self) -> None:
        self._mapped.clear()  # unmapped once the exports are gone


# The pool ----------------------------------------------------------------------------------

_use_count = getattr(torch._C, "_storage_Use_Count", None)  # noqa: SLF001


def only_pool_holds(buf: torch.Tensor) -> bool:
    """No tensor but the pool's own references ``buf``'s storage (2: the pool's tensor and the
    temporary storage object). Without the counter (other torch builds) nothing is reused."""
    return _use_count is not None and _use_count(buf.untyped_storage()._cdata) == 2  # noqa: SLF001


class BufferPool:
    """Host tensors for results and staging, reused once nobody references them.

    Fresh large allocations come from the kernel page by page on first touch; reusing a
    buffer whose storage no tensor holds avoids that on every call. Small host buffers come
    from the allocator directly (cheaper than a pool lookup). With ``mapped`` the first
    buffers of each size class are memory files (``file_of`` names them to peers).
    """

    def __init__(self, mapped: bool) -> None:
        self.mapped = mapped
        self._classes: dict[tuple[int, bool], list[torch.Tensor]] = {}
        self._files: dict[int, tuple[int, int, mmap.mmap]] = {}  # buffer address -> (file id, fd, mapping)
        self._file_ids = itertools.count(1)

    def take(self, shape: tuple, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes <= _SMALL and not pinned:
            return torch.empty(shape, dtype=dtype)
        size = 1 << max(12, (max(nbytes, 1) - 1).bit_length())  # power-of-two classes from 4 KiB
        pool = self._classes.setdefault((size, pinned), [])
        for buf in pool:
            if only_pool_holds(buf):
                break
        else:
            if len(pool) < _POOL_CLASS and not pinned and self.mapped:
                buf = self._memory_file_buffer(size)
            else:
                buf = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
            if len(pool) < _POOL_CLASS:
                pool.append(buf)
        return buf[:nbytes].view(dtype).view(shape)

    def file_of(self, address: int) -> tuple[int, int] | None:
        """(file id, fd) of the memory file a result starting at ``address`` lives in, if any."""
        hit = self._files.get(address)
        return None if hit is None else hit[:2]

    def close(self) -> None:
        for _, fd, _ in self._files.values():
            os.close(fd)  # the memory lives on while results or peers still map it
        self._files.clear()

    def _memory_file_buffer(self, size: int) -> torch.Tensor:
        fd = memory_file(size)
        mapping = mmap.mmap(fd, size)
        buf = torch.frombuffer(mapping, dtype=torch.uint8)
        self._files[buf.data_ptr()] = (next(self._file_ids), fd, mapping)
        return buf


def view(address: int, nbytes: int) -> np.ndarray:
    """The ``nbytes`` bytes at ``address`` as a numpy array (no copy; the owner keeps them alive)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address)) if nbytes else np.zeros(0, np.uint8)
