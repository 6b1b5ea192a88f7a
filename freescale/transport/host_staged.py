"""The SM-free transport: collectives staged through host memory and moved by a CPU proxy.

No kernel of ours runs for a transfer. On CUDA a device tensor is copied into a pinned host
buffer with ``cudaMemcpyAsync`` on a dedicated copy stream (``copy_(non_blocking=True)``), the
proxy thread waits for that copy's event, moves the bytes, and the result is copied back on
the copy stream; the consumer's stream waits on an event, never on the host. On CPU the
staging copies disappear and the proxy path runs as is.

Moving bytes between ranks:

- Ranks on one host share memory. Every ordered pair (src, dst) has a channel: a ring of
  ``slots`` chunks of ``chunk_bytes`` in a POSIX shared-memory segment, with a write and a
  read counter. The proxy of ``src`` copies a chunk in and bumps the write counter; the
  proxy of ``dst`` copies it out and bumps the read counter. Large messages therefore
  pipeline chunk by chunk. Each proxy runs one progress loop over all its channels (sending
  where a ring has room, receiving where one has data), so no order of peers can deadlock.
  The counters are written after the data, and read before it; this relies on x86's ordered
  stores (TSO).
- Ranks on different hosts exchange their splits with gloo point-to-point messages on the
  transport's own process group, driven by the same progress loop.

Segments are created by the receiving rank, opened by the sender, and unlinked as soon as
every rank has opened its channels: from then on they live only as long as some process maps
them, so nothing is left in ``/dev/shm`` even when a peer crashes.

Failure: while a collective makes no progress the proxy checks that the peers it waits for
are alive (same host: their pid). A dead peer, or no progress for ``timeout_s``, fails the
collective: ``wait()`` raises ``TransportError`` naming the operation, the peer and the cause.
Collectives are executed in the order they were issued, as with any process group.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
import uuid
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import torch
import torch.distributed as dist

from freescale.transport.base import TransportError, register

_HEADER = 128  # write counter at byte 0, read counter at byte 64 (separate cache lines)


class _Channel:
    """A ring of ``slots`` chunks between one sender and one receiver."""

    def __init__(self, shm: shared_memory.SharedMemory, chunk: int, slots: int) -> None:
        self.shm = shm
        self.chunk = chunk
        self.slots = slots
        self.counters = np.ndarray((16,), dtype=np.int64, buffer=shm.buf[:_HEADER])
        self.data = np.ndarray((slots * chunk,), dtype=np.uint8, buffer=shm.buf[_HEADER:_HEADER + slots * chunk])

    @staticmethod
    def size(chunk: int, slots: int) -> int:
        return _HEADER + chunk * slots

    def can_write(self) -> bool:
        return int(self.counters[0]) - int(self.counters[8]) < self.slots

    def write(self, src: np.ndarray) -> None:
        seq = int(self.counters[0])
        start = (seq % self.slots) * self.chunk
        self.data[start:start + len(src)] = src
        self.counters[0] = seq + 1

    def can_read(self) -> bool:
        return int(self.counters[0]) > int(self.counters[8])

    def read(self, dst: np.ndarray) -> None:
        seq = int(self.counters[8])
        start = (seq % self.slots) * self.chunk
        dst[:] = self.data[start:start + len(dst)]
        self.counters[8] = seq + 1

    def close(self) -> None:
        self.counters = self.data = None
        self.shm.close()


class _Handle:
    def __init__(self, op: str, finish) -> None:
        self.op = op
        self.finish = finish
        self.done = threading.Event()
        self.error: BaseException | None = None

    def wait(self) -> torch.Tensor:
        self.done.wait()
        if self.error is not None:
            raise TransportError(f"host_staged {self.op}: {self.error}") from self.error
        return self.finish()


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
        self._global = [dist.get_global_rank(self.group, r) for r in range(self.world_size)]

        info = [None] * self.world_size
        dist.all_gather_object(info, (os.uname().nodename, os.getpid()), group=self.group)
        host = info[self.rank][0]
        self.pids = [pid for _, pid in info]
        self.local = [h == host for h, _ in info]
        token = [uuid.uuid4().hex[:12] if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=self._global[0], group=self.group)
        self.prefix = f"freescale-{token[0]}"

        # Inbound rings are created here, outbound ones opened once every rank has created.
        size = _Channel.size(self.chunk, self.slots)
        self.inbound: dict[int, _Channel] = {}
        self.outbound: dict[int, _Channel] = {}
        for src in range(self.world_size):
            if src != self.rank and self.local[src]:
                shm = shared_memory.SharedMemory(name=self._name(src, self.rank), create=True, size=size)
                _untrack(shm)
                shm.buf[:_HEADER] = bytes(_HEADER)
                self.inbound[src] = _Channel(shm, self.chunk, self.slots)
        dist.barrier(group=self.group)
        for dst in range(self.world_size):
            if dst != self.rank and self.local[dst]:
                shm = shared_memory.SharedMemory(name=self._name(self.rank, dst), create=False)
                _untrack(shm)
                self.outbound[dst] = _Channel(shm, self.chunk, self.slots)
        dist.barrier(group=self.group)
        for ch in self.inbound.values():
            shared_memory._posixshmem.shm_unlink(ch.shm._name)  # noqa: SLF001  (untracked: see _untrack)

        self._pinned: dict[str, torch.Tensor] = {}
        self._outputs: dict[tuple, list[torch.Tensor]] = {}
        self._copy_stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self._ops: queue.Queue = queue.Queue()
        self._closed = False
        self._proxy = threading.Thread(target=self._serve, name=f"host-staged-proxy-{self.rank}", daemon=True)
        self._proxy.start()

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
        self._ops.put(None)
        self._proxy.join(timeout=5)
        for ch in (*self.inbound.values(), *self.outbound.values()):
            ch.close()

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
        row_bytes = tensor.element_size() * int(np.prod(row_shape, dtype=np.int64))
        out_host = self._output((sum(output_splits), *row_shape), tensor.dtype, pinned=tensor.is_cuda)
        ready = None
        if tensor.is_cuda:
            host_in = self._staging("in", tensor)
            ready = torch.cuda.Event()
            self._copy_stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(self._copy_stream):
                host_in.copy_(tensor, non_blocking=True)
                ready.record(self._copy_stream)
            src = host_in
        else:
            src = tensor
        send = src.reshape(-1).view(torch.uint8).numpy() if src.numel() else np.zeros(0, dtype=np.uint8)
        recv = out_host.reshape(-1).view(torch.uint8).numpy() if out_host.numel() else np.zeros(0, dtype=np.uint8)

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

        handle = _Handle(op, finish)
        in_bytes = [n * row_bytes for n in input_splits]
        # Every destination of an all-gather reads the same bytes: its offsets all start at 0.
        in_offsets = [0] * self.world_size if gather else [0, *itertools.accumulate(in_bytes)][:-1]
        out_bytes = [n * row_bytes for n in output_splits]
        out_offsets = [0, *itertools.accumulate(out_bytes)][:-1]
        self._ops.put((handle, ready, send, in_offsets, in_bytes, recv, out_offsets, out_bytes, (tensor, out_host)))
        return handle

    def _output(self, shape: tuple, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        """A host tensor for a result, from a pool of buffers the callers have let go of.

        Fresh large allocations come from the kernel page by page on first touch; reusing a
        buffer whose storage nobody references any more avoids that on every call.
        """
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        size = 1 << max(12, (max(nbytes, 1) - 1).bit_length())  # power-of-two classes from 4 KiB
        pool = self._outputs.setdefault((size, pinned), [])
        for buf in pool:
            if _only_pool_holds(buf):
                break
        else:
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
            if len(pool) < 4:
                pool.append(buf)
        return buf[:nbytes].view(dtype).view(shape)

    def _staging(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """A reused pinned host buffer at least as large as ``like`` (grown, never shrunk per call)."""
        nbytes = like.numel() * like.element_size()
        buf = self._pinned.get(key)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
            self._pinned[key] = buf
        return buf[:nbytes].view(like.dtype).view(like.shape)

    # The proxy -----------------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            item = self._ops.get()
            if item is None:
                return
            handle = item[0]
            try:
                self._run(*item[1:-1])
            except BaseException as e:  # delivered to wait(); the proxy carries on with later ops
                handle.error = e
            handle.done.set()

    def _run(self, ready, send, in_offsets, in_bytes, recv, out_offsets, out_bytes) -> None:
        if ready is not None:
            ready.synchronize()
        me = self.rank
        own_copied = False
        sent = {d: 0 for d in range(self.world_size) if d != me}
        got = {s: 0 for s in range(self.world_size) if s != me}
        remote = self._start_remote(send, in_offsets, in_bytes, recv, out_offsets, out_bytes)
        deadline = time.monotonic() + self.timeout_s
        next_check = time.monotonic() + 0.05
        idle_since = None
        while True:
            progressed = False
            for d, ch in self.outbound.items():
                while sent[d] < in_bytes[d] and ch.can_write():
                    n = min(self.chunk, in_bytes[d] - sent[d])
                    start = in_offsets[d] + sent[d]
                    ch.write(send[start:start + n])
                    sent[d] += n
                    progressed = True
            if not own_copied:
                # This rank's own share, copied while the peers read the first chunks.
                recv[out_offsets[me]:out_offsets[me] + out_bytes[me]] = send[in_offsets[me]:in_offsets[me] + in_bytes[me]]
                own_copied = True
            for s, ch in self.inbound.items():
                while got[s] < out_bytes[s] and ch.can_read():
                    n = min(self.chunk, out_bytes[s] - got[s])
                    start = out_offsets[s] + got[s]
                    ch.read(recv[start:start + n])
                    got[s] += n
                    progressed = True
            remote = [w for w in remote if not w.is_completed()]
            pending_send = [d for d, ch in self.outbound.items() if sent[d] < in_bytes[d]]
            pending_recv = [s for s, ch in self.inbound.items() if got[s] < out_bytes[s]]
            if not pending_send and not pending_recv and not remote:
                return
            now = time.monotonic()
            if progressed:
                deadline = now + self.timeout_s
                idle_since = None
                continue
            idle_since = idle_since or now
            if now >= next_check:
                next_check = now + 0.05
                for peer in sorted(set(pending_send) | set(pending_recv)):
                    if not _alive(self.pids[peer]):
                        raise RuntimeError(f"peer rank {peer} (pid {self.pids[peer]}) died")
                if now >= deadline:
                    waiting = sorted(set(pending_send) | set(pending_recv)) or ["remote peers"]
                    raise RuntimeError(f"no progress for {self.timeout_s:g} s waiting for rank(s) {waiting}")
            # Yield first (a peer's chunk is usually microseconds away), then back off.
            time.sleep(0 if now - idle_since < 0.001 else 0.0002)

    def _start_remote(self, send, in_offsets, in_bytes, recv, out_offsets, out_bytes) -> list:
        """Gloo point-to-point for peers on other hosts."""
        works = []
        for peer in range(self.world_size):
            if peer == self.rank or self.local[peer]:
                continue
            if in_bytes[peer]:
                chunk = torch.from_numpy(send[in_offsets[peer]:in_offsets[peer] + in_bytes[peer]])
                works.append(dist.isend(chunk, self._global[peer], group=self.group))
            if out_bytes[peer]:
                chunk = torch.from_numpy(recv[out_offsets[peer]:out_offsets[peer] + out_bytes[peer]])
                works.append(dist.irecv(chunk, self._global[peer], group=self.group))
        return works


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


def _untrack(shm: shared_memory.SharedMemory) -> None:
    """Keep Python's resource tracker out: creating and opening a segment both register it (and
    ranks spawned from one parent share a tracker), while the lifetime here is explicit."""
    try:
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
    except Exception:
        pass
