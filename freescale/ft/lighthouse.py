"""torchft's lighthouse: the one service every replica group's manager reports to.

It forms each step's quorum of live groups. A group whose heartbeats stop for
``heartbeat_timeout_ms`` is dead to it: the next quorum goes on without it (torchft's default
of 5 s is what a healthy group would stall on a dead peer; FreeScale's is 500 ms, and the
managers beat every 100 ms). It binds to loopback unless told otherwise: one host's replica
groups need nothing more; for several hosts, bind an address the others can reach.
"""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass

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


def serve(options: LighthouseOptions) -> None:
    """Run the lighthouse until SIGINT or SIGTERM."""
    server = start_lighthouse(options)
    address = address_of(options)
    print(f"lighthouse at {address} (min replicas {options.min_replicas}, heartbeat timeout "
          f"{options.heartbeat_timeout_ms} ms); replicas: --ft.lighthouse={address}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
