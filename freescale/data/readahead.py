"""Read-ahead: a background thread that keeps the next few items of an iterator ready.

The loader's batches (reading row groups, decoding, drawing negatives) are produced on this
thread while the trainer computes, so the bubble report's ``data wait`` is only the hand-over
from a queue. The iterator is consumed in order and its items come out in the same order; an
exception on the thread is raised on the consumer's next call, as itself. ``close`` stops the
thread (the items it had read are dropped: a resumed run reads them again from its cursor).
"""

from __future__ import annotations

import queue
import threading
from typing import Iterator, TypeVar

T = TypeVar("T")
_DONE = object()


class ReadAhead(Iterator[T]):
    """Iterates ``source`` with up to ``depth`` items read ahead on a daemon thread."""

    def __init__(self, source: Iterator[T], depth: int, name: str = "freescale-read-ahead") -> None:
        if depth < 1:
            raise ValueError(f"read-ahead depth must be >= 1, got {depth}")
        self._source = source
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for item in self._source:
                if not self._put((item, None)):
                    return
            self._put((_DONE, None))
        except BaseException as e:  # handed to the consumer, raised there
            self._put((None, e))

    def _put(self, entry) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __next__(self) -> T:
        if self._stop.is_set():
            raise StopIteration
        item, error = self._queue.get()
        if error is not None:
            self.close()
            raise error
        if item is _DONE:
            self.close()
            raise StopIteration
        return item

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


def read_ahead(source: Iterator[T], depth: int) -> Iterator[T]:
    """``source`` read ``depth`` items ahead on a thread (``depth`` 0: ``source`` itself)."""
    return ReadAhead(source, depth) if depth > 0 else source
