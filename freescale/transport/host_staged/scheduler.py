"""Who runs a collective, and when: the queue, the proxy thread, the failure latch.

Collectives are queued per lane in the order they are issued (as with any process group)
and run one at a time by whichever thread holds the run lock:

- a caller that waits for its collective before the proxy has started it runs the queue up
  to it itself (``drive``): no hand-off between threads;
- the proxy thread takes over whatever nobody has waited for ``GRACE_S`` after it was
  issued, woken by a one-shot ``timerfd`` alarm (``Alarm``): arming it is one system call and
  wakes nobody, so issuing early and waiting later overlaps the transfer with the caller's
  compute. Without ``timerfd`` the proxy is woken at once for every collective.

Errors are state. The first collective that fails latches the scheduler: every later one is
refused with the cause, since the peers' state is unknown. ``abort(cause)`` (any thread)
latches too and fails every pending collective at once, the running one included: its
waiter returns now, while the thread running it stops at its next look at the latch.

Lanes: each lane has its own sequence (a collective's ``OpKey`` is (lane, sequence), on the
wire too) and its own rings. The queue runs the highest lane's first collective first, and a
collective running on a lower lane takes a higher lane's collective issued meanwhile along
(``take_passing``): its runner starts it and steps both exchanges, the higher lane first, so
a small high-priority collective does not wait for a large normal one to finish.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import os
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from freescale.transport.base import TransportError
from freescale.transport.host_staged.wire import OpKey

GRACE_S = 0.001  # how long the proxy leaves a new collective to a caller that waits for it at once
NORMAL = 0  # the lane every collective takes today

_libc = ctypes.CDLL(None, use_errno=True)


class Handle:
    """What a collective returns: ``wait()`` runs or awaits it, then gives the result or raises."""

    __slots__ = ("op", "finish", "drive", "done", "error", "_settle", "__weakref__")

    def __init__(self, op: str, finish: Callable[[], torch.Tensor], drive: Callable[["Handle"], None]) -> None:
        self.op = op
        self.finish = finish
        self.drive = drive
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._settle = threading.Lock()

    def wait(self) -> torch.Tensor:
        self.drive(self)
        if self.error is not None:
            raise TransportError(f"host_staged {self.op}: {self.error}") from self.error
        return self.finish()

    def completed(self) -> bool:
        return self.done.is_set()

    def complete(self, error: BaseException | None = None) -> bool:
        """Settle the handle once (success, or ``error``); whether this call settled it."""
        with self._settle:
            if self.done.is_set():
                return False
            self.error = error
            self.done.set()
            return True


@dataclass(slots=True)
class Op:
    """One collective as the proxy sees it: addresses, per-peer offsets and lengths in bytes."""

    key: OpKey
    handle: Handle
    ready: object  # an event whose ``query()`` says ``send`` holds the input (a staging copy), or None
    send: int  # address of the bytes to send (held alive by ``keep``)
    in_offsets: list[int]
    in_bytes: list[int]
    recv: int  # address of the result's bytes
    out_offsets: list[int]
    out_bytes: list[int]
    keep: tuple = field(default=())  # tensors that must live until the collective ends


class Scheduler:
    """The queue of collectives and the proxy thread that runs what nobody waits for.

    ``run(op)`` moves one collective's bytes (raising on failure); ``on_failure(op)`` tells the
    peers. Both are called by whichever thread holds the run lock.
    """

    def __init__(self, rank: int, run: Callable[[Op], None], on_failure: Callable[[Op], None]) -> None:
        self._run = run
        self._on_failure = on_failure
        self._queue: collections.deque[Op] = collections.deque()
        self._running: Op | None = None
        self._sequence: dict[int, itertools.count] = collections.defaultdict(itertools.count)  # per lane
        self._passing: list[Op] = []  # higher-lane collectives a running one took along, not yet settled
        self.nudge: Callable[[], None] | None = None  # tells a running collective that one may pass it
        self._lock = threading.Lock()  # the queue, the running op and the alarm change together
        self._exec = threading.Lock()  # held by whichever thread runs collectives (proxy or a waiter)
        self.failed: str | None = None  # the latch: why collectives are refused
        self.closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._alarm = Alarm.create(GRACE_S)  # None where timerfd is missing: the proxy is woken at once
        self._proxy = threading.Thread(target=self._serve, name=f"host-staged-proxy-{rank}", daemon=True)
        self._proxy.start()

    def next_key(self, lane: int = NORMAL) -> OpKey:
        return OpKey(lane, next(self._sequence[lane]))

    def submit(self, op: Op) -> None:
        with self._lock:
            self._queue.append(op)
            if self._alarm is not None:
                self._alarm.arm()
        if self._alarm is None:
            self._wake()
        if op.key.lane > NORMAL and self.nudge is not None:
            self.nudge()

    def take_passing(self, lane: int) -> Op | None:
        """The first queued collective of a lane above ``lane`` (now the caller's to run), or None."""
        with self._lock:
            op = next((o for o in self._queue if o.key.lane > lane), None)
            if op is not None and not self.failed:
                self._queue.remove(op)
                self._passing.append(op)
                return op
        return None

    def settle_passing(self, op: Op, error: BaseException | None = None) -> None:
        """A collective taken by ``take_passing`` is over (``error``: it failed, and latches)."""
        with self._lock:
            if op in self._passing:
                self._passing.remove(op)
            if error is not None:
                self.failed = self.failed or str(error)
        op.handle.complete(error)
        if error is not None:
            self._on_failure(op)

    def drive(self, handle: Handle) -> None:
        """Wait for ``handle``, running the queued collectives up to it here if the proxy is idle.

        A caller that waits right after issuing then pays no hand-off to the proxy thread; one
        that computes in between finds its collective already done (or under way) by the proxy.
        The alarm is left to fire: one idle wake-up of the proxy costs less than disarming after
        every collective (a timer system call each).
        """
        while not handle.done.is_set():
            self._run_queued(until=handle)
            handle.done.wait(0.01)

    def abort(self, cause: str) -> None:
        """Latch ``cause`` and fail every pending collective now (the running one included)."""
        with self._lock:
            self.failed = self.failed or cause
            pending = ([self._running] if self._running else []) + self._passing + list(self._queue)
            self._queue.clear()
            self._passing = []
        for op in pending:
            op.handle.complete(RuntimeError(cause))
        self._wake()

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop the proxy; whether every thread has left the collectives' memory."""
        if not self.closed:
            self.closed = True
            self._wake()
            self._proxy.join(timeout=timeout_s)
        free = self._exec.acquire(timeout=timeout_s)
        if free:
            self._exec.release()
            # Drop the callbacks: they hold the transport, and through it the process group,
            # which must not outlive destroy_process_group() in a reference cycle.
            self._run = self._on_failure = None
            self._wake_r.close()
            self._wake_w.close()
            if self._alarm is not None:
                self._alarm.close()
        return free and not self._proxy.is_alive()

    # Running -------------------------------------------------------------------------------

    def _serve(self) -> None:
        """The proxy: take over collectives that nobody has started ``GRACE_S`` after they were issued."""
        waits = [self._wake_r] if self._alarm is None else [self._wake_r, self._alarm]
        while not self.closed:
            select.select(waits, [], [])
            try:
                self._wake_r.recv(4096)
            except (BlockingIOError, OSError):
                pass
            if self._alarm is None:
                time.sleep(GRACE_S)
            else:
                with self._lock:
                    self._alarm.take()
            self._run_queued()

    def _run_queued(self, until: Handle | None = None) -> None:
        """Run queued collectives (up to ``until``'s) unless another thread is running them."""
        if not self._exec.acquire(blocking=False):
            return  # that thread hands over (below) when it stops with collectives left
        try:
            while self._queue and not self.closed and not (until and until.done.is_set()):
                op = self._running = self._pop_next()
                if op is None:  # aborted meanwhile
                    break
                self._run_one(op)  # one that abort() missed between the two lines fails at its latch check
        finally:
            self._running = None
            self._exec.release()
        if self._queue and until is not None:
            self._wake()  # later collectives: the proxy takes them

    def _pop_next(self) -> Op | None:
        """The first queued collective of the highest lane that has one."""
        with self._lock:
            if not self._queue:
                return None
            top = max(o.key.lane for o in self._queue)
            op = next(o for o in self._queue if o.key.lane == top)
            self._queue.remove(op)
            return op

    def _run_one(self, op: Op) -> None:
        """Run ``op`` (the caller holds the run lock); a failure latches and is told to the peers."""
        try:
            if self.failed:
                raise RuntimeError(f"an earlier collective failed: {self.failed}")
            self._run(op)
        except BaseException as e:  # delivered to wait(); later collectives fail the same way
            with self._lock:
                self.failed = self.failed or str(e)
            op.handle.complete(e)
            self._on_failure(op)
        else:
            op.handle.complete()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # a wake-up is already pending (or the scheduler is closing)


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("interval", _Timespec), ("value", _Timespec)]


_timerfd_settime = getattr(_libc, "timerfd_settime", None)


class Alarm:
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
    def create(cls, seconds: float) -> "Alarm | None":
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
