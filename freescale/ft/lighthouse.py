"""torchft's lighthouse: the one service every replica group's manager reports to.

It forms each step's quorum of live groups. A group whose heartbeats stop for
``heartbeat_timeout_ms`` is dead to it: the next quorum goes on without it (torchft's default
of 5 s is what a healthy group would stall on a dead peer; FreeScale's is 500 ms, and the
managers beat every 100 ms). It binds to loopback unless told otherwise: one host's replica
groups need nothing more; for several hosts, bind an address the others can reach.

Run as a job of its own (a cluster's, ``freescale.torchx``), it is told the run folder and the
number of groups (``RunWatch``) and exits once every group has finished the run, so the job
ends with its groups rather than at the scheduler's time limit.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass, field

DEFAULT_BIND = "127.0.0.1:29510"


@dataclass(frozen=True)
class LighthouseOptions:
    bind: str = DEFAULT_BIND
    min_replicas: int = 1
    heartbeat_timeout_ms: int = 500
    join_timeout_ms: int = 1000
    quorum_tick_ms: int = 50


def address_of(options: LighthouseOptions) -> str:
    """What replicas set as ``ft.lighthouse`` (the bound address: the server's own names the host,
    which may resolve to an address it does not listen on)."""
    return f"http://{options.bind}"


def start_lighthouse(options: LighthouseOptions):
    """A running ``torchft`` ``LighthouseServer`` (``shutdown()`` stops it)."""
    from torchft.coordination import LighthouseServer

    if options.min_replicas < 1:
        raise ValueError(f"--min-replicas: expected a value >= 1, got {options.min_replicas}")
    host, _, port = options.bind.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--bind: expected HOST:PORT, got {options.bind!r}")
    try:
        return LighthouseServer(bind=options.bind, min_replicas=options.min_replicas,
                                join_timeout_ms=options.join_timeout_ms, quorum_tick_ms=options.quorum_tick_ms,
                                heartbeat_timeout_ms=options.heartbeat_timeout_ms)
    except Exception as e:  # the Rust server raises a plain RuntimeError (address in use, bad address)
        raise ValueError(f"cannot start the lighthouse on {options.bind}: {str(e).splitlines()[0]}") from e


SUMMARY_FILE = "summary.json"  # what the trainer's main rank writes once its group reached the last step


@dataclass
class RunWatch:
    """Whether every replica group of a run (``<run_dir>/replica<r>/``, the layout ``freescale
    local`` and ``freescale.torchx`` make) has finished: each has written its ``summary.json``
    since the watch began. A summary already there (a folder a run is resumed in) counts only
    once it is written again; the test is a change of the file, not of a clock, so a shared
    file system's clock may differ from this host's."""

    run_dir: str
    replicas: int
    _before: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas: expected a value >= 1, got {self.replicas}")
        self._before = {r: self._stamp(r) for r in range(self.replicas)}

    def _stamp(self, replica: int):
        try:
            st = os.stat(os.path.join(self.run_dir, f"replica{replica}", SUMMARY_FILE))
        except FileNotFoundError:
            return None
        return st.st_mtime_ns, st.st_ino, st.st_size

    def finished(self) -> bool:
        return all(self._stamp(r) not in (None, self._before[r]) for r in range(self.replicas))


def serve(options: LighthouseOptions, watch: RunWatch | None = None, poll_s: float = 1.0) -> None:
    """Run the lighthouse until SIGINT or SIGTERM, or until ``watch`` sees the run finished."""
    server = start_lighthouse(options)
    address = address_of(options)
    print(f"lighthouse at {address} (min replicas {options.min_replicas}, heartbeat timeout "
          f"{options.heartbeat_timeout_ms} ms); replicas: --ft.lighthouse={address}"
          + (f"; exits when the {watch.replicas} group(s) in {watch.run_dir} finish" if watch else ""), flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(poll_s if watch else None):
        if watch.finished():
            print(f"lighthouse: every replica group in {watch.run_dir} finished the run", flush=True)
            break
    server.shutdown()
