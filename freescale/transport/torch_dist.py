"""The reference transport: ``torch.distributed`` collectives (gloo on CPU, NCCL on CUDA).

How a waiter waits depends on the backend that runs the work:

- gloo: in slices of ``_SLICE``, looking at the failure latch between them, so that
  ``abort()`` releases every waiter within a slice: gloo's own ``abort()`` does not end a
  pending collective (it ends when the peer's connection does). gloo's ``wait(timeout)`` only
  stops waiting when the time is up. A work's future, the other way to wait without blocking,
  is not used since holding one makes gloo processes abort at exit now and then.
- NCCL: one ``wait()`` without a timeout, which blocks no host thread: it makes the current
  stream wait for the collective. NCCL's ``wait(timeout)`` measures the timeout from when the
  work was *enqueued* and, once it has passed, aborts the communicator and raises; the
  prioritized pipeline waits for its early exchanges a step after issuing them by design, so a
  sliced wait there would kill the lane at its first such wait.

The process group is the caller's and is left as it is; an aborted collective may still
complete in gloo's threads, unseen.
"""

from __future__ import annotations

import datetime
import threading
import weakref

import torch
import torch.distributed as dist

from freescale.distributed import new_group_like
from freescale.errors import first_line
from freescale.transport.base import (NORMAL, TransportError, check_all_gather, check_all_to_all, check_lane,
                                      check_lanes)

_SLICE = datetime.timedelta(milliseconds=10)  # how long a waiter waits before it looks at the latch again


def sliced_wait_is_safe(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether a wait with a timeout on ``group``'s work over tensors on ``device`` only stops
    waiting (gloo), rather than aborting the communicator (NCCL; any backend not known to be
    safe is waited for without a timeout)."""
    try:
        return group._get_backend(torch.device(device.type)).name() == "gloo"
    except RuntimeError:  # no backend for that device
        return False


class _WorkHandle:
    def __init__(self, transport: "TorchDistTransport", op: str, work, finish, sliced: bool = True) -> None:
        self.transport = transport
        self.op = op
        self.work = work
        self.finish = finish
        self.sliced = sliced  # wait in slices (gloo), or once without a timeout (NCCL)
        self.error: BaseException | None = None
        self._settle = threading.Lock()

    def fail(self, error: BaseException) -> None:
        with self._settle:
            self.error = self.error or error

    def completed(self) -> bool:
        return self.error is not None or self.work.is_completed()

    def _wait_once(self) -> None:
        if self.sliced:
            self.work.wait(_SLICE)
        else:
            self.work.wait()  # NCCL: the current stream waits for the collective, no host thread does

    def wait(self) -> torch.Tensor:
        while self.error is None:
            try:
                self._wait_once()
                break
            except RuntimeError:
                if self.sliced and not self.work.is_completed():
                    continue  # the slice ran out: look at the latch, wait on
            try:  # completed, maybe just after the slice ran out: a second wait tells how
                self._wait_once()
                break
            except RuntimeError as e:
                first = first_line(e)
                self.fail(TransportError(f"torch_dist {self.op} failed: {first}"))
                self.error.__cause__ = e
                self.transport._latch(f"{self.op} failed: {first}")
        self.transport._forget(self)
        if self.error is not None:
            raise self.error
        return self.finish()


class TorchDistTransport:
    name = "torch_dist"
    lane_has_threads = True
    """A lane is a process group, with threads of its own (gloo's)."""

    def __init__(self, group: dist.ProcessGroup | None = None, cfg=None, lanes: int = 1) -> None:
        self.group = group or dist.group.WORLD
        # One process group per lane: gloo (and NCCL) run a group's collectives in issue order,
        # so a lane of its own is what lets a high-priority collective pass.
        self.lanes = check_lanes(self.name, lanes)
        self.lane_groups = [self.group] + [new_group_like(self.group, backend="same") for _ in range(lanes - 1)]
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self._lock = threading.Lock()
        self._pending: weakref.WeakSet[_WorkHandle] = weakref.WeakSet()  # issued, not yet waited for
        self._cause: str | None = None  # why the transport failed, once it has
        self._waits: dict = {}  # (group, device type) -> whether its work is waited for in slices

    def all_to_all_single(self, tensor: torch.Tensor, input_splits, output_splits, lane: int = NORMAL):
        tensor, ins, outs = check_all_to_all(self.name, self.rank, self.world_size, tensor, input_splits, output_splits)
        group = self.lane_groups[check_lane(self.name, lane, self.lanes)]
        self._refuse_if_failed("all_to_all_single")
        out = tensor.new_empty((sum(outs), *tensor.shape[1:]))
        work = dist.all_to_all_single(out, tensor, output_split_sizes=outs, input_split_sizes=ins,
                                      group=group, async_op=True)
        return self._track(_WorkHandle(self, "all_to_all_single", work, lambda: out, self._sliced(group, tensor)))

    def all_gather(self, tensor: torch.Tensor, sizes=None):
        tensor, sizes = check_all_gather(self.name, self.rank, self.world_size, tensor, sizes)
        self._refuse_if_failed("all_gather")
        width = max(sizes) if sizes else 0
        padded = tensor.new_zeros((width, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        work = dist.all_gather(parts, padded, group=self.group, async_op=True)
        return self._track(_WorkHandle(self, "all_gather", work, lambda: torch.cat([p[:n] for p, n in zip(parts, sizes)]),
                                       self._sliced(self.group, tensor)))

    def _sliced(self, group: dist.ProcessGroup, tensor: torch.Tensor) -> bool:
        key = (group, tensor.device.type)
        if key not in self._waits:
            self._waits[key] = sliced_wait_is_safe(group, tensor.device)
        return self._waits[key]

    def errored(self) -> Exception | None:
        return None if self._cause is None else TransportError(f"torch_dist: {self._cause}")

    def abort(self, cause: str = "aborted") -> None:
        self._latch(cause)
        with self._lock:
            pending = list(self._pending)
        for handle in pending:
            handle.fail(TransportError(f"torch_dist {handle.op}: {cause}"))

    def close(self) -> None:
        self.abort("the transport was closed")

    # Failure latch -----------------------------------------------------------------------

    def _refuse_if_failed(self, op: str) -> None:
        if self._cause is not None:
            raise TransportError(f"torch_dist {op}: refused: {self._cause}")

    def _latch(self, cause: str) -> None:
        with self._lock:
            self._cause = self._cause or cause

    def _track(self, handle: _WorkHandle) -> _WorkHandle:
        with self._lock:
            self._pending.add(handle)
        return handle

    def _forget(self, handle: _WorkHandle) -> None:
        with self._lock:
            self._pending.discard(handle)
