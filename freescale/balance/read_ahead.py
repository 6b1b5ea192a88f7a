"""A read-ahead for producers that issue collectives: items made on a thread, a window ahead.

``CollectiveReadAhead(produce, depth)`` calls ``produce()`` on a thread of its own, item after
item, and hands the items out in order; the consumer's ``next()`` only takes a finished one
(or waits for it). The thread starts item ``j`` only once the consumer has taken item
``j - depth``: at most ``depth`` items are started and not yet taken.

Every rank runs the same producer, whose collectives must be issued in the same order on every
rank and all of them on every rank (a collective one rank issues and another never does hangs
until a timeout). The window is counted in items *taken*, so ranks that have taken the same
items may start the same items, whatever their threads' speeds; ``close()`` therefore does not
stop the thread where it happens to be, but lets it start what the window still allows and
stops it once the window is full: every rank's thread stops after the same item, with no
collective left that a peer never issues. (``freescale.data.readahead`` stops its thread at
once, dropping what it read: right for a loader, whose reads no peer waits for.) Where the
thread cannot get there (a peer stopped early, after a failure) ``close()`` gives it
``DRAIN_S``, then calls ``abort`` (the producer's transport fails its pending collectives)
and the thread ends with them.

``produce()`` raising ``StopIteration`` ends the items; any other exception is handed to the
consumer and raised by the ``next()`` that wants that item, as itself (the items made before
it come out first).
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Generic, TypeVar

from freescale.logging import get_logger

T = TypeVar("T")

DRAIN_S = 10.0
"""How long ``close()`` lets the thread finish the items its window allows before aborting it:
on a clean end that is at most ``depth`` items every peer makes too, on a failure the peers'
collectives it waits for may never come."""


class CollectiveReadAhead(Generic[T]):
    """Items of ``produce()`` made on a thread named ``name``, at most ``depth`` started ahead of
    the ones taken; ``abort(cause)`` fails the producer's pending collectives (see the module
    docstring)."""

    def __init__(self, produce: Callable[[], T], depth: int, *, abort: Callable[[str], None],
                 name: str = "freescale-read-ahead") -> None:
        if depth < 1:
            raise ValueError(f"read-ahead depth must be >= 1, got {depth}")
        self._produce = produce
        self._depth = depth
        self._abort = abort
        self._cond = threading.Condition()
        self._ready: collections.deque = collections.deque()  # made, not yet taken
        self._started = 0  # items the thread has started
        self._taken = 0  # items the consumer has taken
        self._ended = False  # produce() raised StopIteration
        self._error: BaseException | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # The thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._may_start():
                item = self._produce()
                with self._cond:
                    self._ready.append(item)
                    self._cond.notify_all()
        except StopIteration:
            with self._cond:
                self._ended = True
                self._cond.notify_all()
        except BaseException as e:  # raised on the consumer's thread
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _may_start(self) -> bool:
        """Wait for room in the window; False once closed with the window full (every rank's
        thread stops at that same item)."""
        with self._cond:
            while self._started - self._taken >= self._depth:
                if self._closing:
                    return False
                self._cond.wait()
            self._started += 1
            return True

    # The consumer --------------------------------------------------------------------------

    def __iter__(self) -> "CollectiveReadAhead[T]":
        return self

    def __next__(self) -> T:
        with self._cond:
            while not self._ready and self._error is None and not self._ended and not self._closing:
                self._cond.wait()
            if self._closing:
                raise StopIteration
            if self._ready:
                self._taken += 1
                self._cond.notify_all()
                return self._ready.popleft()
            if self._error is not None:
                raise self._error
            raise StopIteration

    def close(self) -> None:
        """Let the thread fill the window and stop (at most ``DRAIN_S``), else abort it; then
        join it. Items not taken are dropped (a resumed run makes them again from its cursor)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is threading.current_thread():
            return
        self._thread.join(DRAIN_S)
        if self._thread.is_alive():
            self._abort(f"the read-ahead was closed and its thread did not stop within {DRAIN_S:.0f} s")
            self._thread.join(DRAIN_S)
        if self._thread.is_alive():
            get_logger().warning(f"{self._thread.name}: still running after close (blocked outside the transport)")
