"""torchft's lighthouse: the one service every replica group's manager reports to.

It forms each step's quorum of live groups. A group whose heartbeats stop for
``heartbeat_timeout_ms`` is dead to it: the next quorum goes on without it (torchft's default
of 5 s is what a healthy group would stall on a dead peer; FreeScale's is 500 ms, and the
managers beat every 100 ms). It binds to loopback unless told otherwise: one host's replica
groups need nothing more; for several hosts, bind an address the others can reach.

Run as a job of its own (a cluster's, ``freescale.torchx``), it is told the run folder and the
number of groups (``RunWatch``) and exits once every group has finished the run, so the job
ends with its groups rather than at the scheduler's time limit.

``freescale lighthouse`` prints a line when the groups in the quorum change and, at most once a
minute, how many quorums it formed meanwhile (``QuorumLog``, from its own status page); torchft's
own log (every heartbeat and quorum) is turned down to warnings unless ``RUST_LOG`` says
otherwise.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import re
import signal
import socket
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field

DEFAULT_BIND = "127.0.0.1:29510"


@dataclass(frozen=True)
class LighthouseOptions:
    bind: str = DEFAULT_BIND
    min_replicas: int = 1
    heartbeat_timeout_ms: int = 500
    join_timeout_ms: int = 1000
    quorum_tick_ms: int = 50


WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]")


def address_of(options: LighthouseOptions) -> str:
    """What replicas set as ``ft.lighthouse``: the bound address (the server's own names the
    host, which may resolve to an address it does not listen on), or, bound to every interface,
    this host's name, which other hosts can reach."""
    host, _, port = options.bind.rpartition(":")
    if host in WILDCARD_HOSTS:
        host = socket.getfqdn() or socket.gethostname()
    return f"http://{host}:{port}"


def local_address_of(options: LighthouseOptions) -> str:
    """Where this host reads the lighthouse's own status page."""
    host, _, port = options.bind.rpartition(":")
    return f"http://{'127.0.0.1' if host in WILDCARD_HOSTS else host}:{port}"


@dataclass(frozen=True)
class LighthouseStatus:
    """What the lighthouse's status page says: its last quorum and the age of every heartbeat."""

    quorum_id: int | None
    """The last quorum formed (None: none yet)."""
    members: tuple[str, ...]
    """Its members' replica ids (``replica<g>:<uuid>``)."""
    heard: dict[str, float]
    """Replica id -> seconds since its last heartbeat (every group the lighthouse ever heard)."""


_QUORUM = re.compile(r"Previous quorum id:\s*(\d+)")
_MEMBER = re.compile(r'<div class="member[^>]*>\s*<b>([^<]+)</b>')
_HEARD = re.compile(r"([^\s<>]+): seen ([0-9.eE+-]+)s ago")


def parse_status(page: str) -> LighthouseStatus:
    """torchft's lighthouse status page (``templates/status.html``), read."""
    quorum = _QUORUM.search(page)
    return LighthouseStatus(quorum_id=int(quorum.group(1)) if quorum else None,
                            members=tuple(m.strip() for m in _MEMBER.findall(page)),
                            heard={r: float(age) for r, age in _HEARD.findall(page)})


def read_status(lighthouse: str, timeout: float) -> LighthouseStatus:
    with urllib.request.urlopen(lighthouse.rstrip("/") + "/status", timeout=timeout) as response:
        return parse_status(response.read().decode())


def group_of(replica_id: str) -> str:
    """``replica2:<uuid>`` -> ``replica2`` (torchft appends a uuid per manager it starts)."""
    return replica_id.split(":", 1)[0]


@dataclass
class QuorumLog:
    """The lighthouse's log lines from its status pages (``update``): one when the groups in the
    quorum change, and at most one per ``summary_s`` of how many quorums it formed meanwhile
    (every failed step makes a new one, which would otherwise be a line each)."""

    summary_s: float = 60.0
    _quorum: int | None = None
    _groups: tuple[str, ...] = ()
    _formed: int = 0
    _since: float | None = None

    def update(self, status: LighthouseStatus, now: float) -> list[str]:
        lines = []
        if self._since is None:
            self._since = now
        if status.quorum_id is not None and status.quorum_id != self._quorum:
            groups = tuple(sorted({group_of(m) for m in status.members}))
            if groups != self._groups:
                joined = [g for g in groups if g not in self._groups]
                left = [g for g in self._groups if g not in groups]
                change = "; ".join([f"{', '.join(joined)} joined"] * bool(joined) + [f"{', '.join(left)} left"] * bool(left))
                lines.append(f"lighthouse: quorum {status.quorum_id} of {len(groups)} group(s): {', '.join(groups)}"
                             + (f" ({change})" if change else ""))
            else:
                self._formed += 1
            self._quorum, self._groups = status.quorum_id, groups
        if now - self._since >= self.summary_s:
            if self._formed:
                lines.append(f"lighthouse: {self._formed} more quorum(s) of the same groups in the last "
                             f"{now - self._since:.0f} s (each failed step forms one), the last {self._quorum}")
            self._formed, self._since = 0, now
        return lines


def _lighthouse_server_class():
    """torchft's ``LighthouseServer``, from its Rust extension (``torchft._torchft``) alone.

    The package's ``__init__`` imports torch and torchft's Manager (2-3 s of CPU), which a
    lighthouse never uses; loaded by itself, the extension takes milliseconds, so ``freescale
    local`` starts its groups and ``freescale lighthouse`` answers that much sooner. Where torchft
    is imported already, or its layout is not the one expected, the usual import."""
    if "torchft" not in sys.modules:
        spec = importlib.util.find_spec("torchft")
        for folder in (spec.submodule_search_locations or []) if spec else []:
            for suffix in importlib.machinery.EXTENSION_SUFFIXES:
                path = os.path.join(folder, "_torchft" + suffix)
                if os.path.exists(path):
                    loader = importlib.machinery.ExtensionFileLoader("torchft._torchft", path)
                    module = importlib.util.module_from_spec(
                        importlib.util.spec_from_file_location("torchft._torchft", path, loader=loader))
                    loader.exec_module(module)
                    return module.LighthouseServer
    from torchft.coordination import LighthouseServer

    return LighthouseServer


def start_lighthouse(options: LighthouseOptions):
    """A running ``torchft`` ``LighthouseServer`` (``shutdown()`` stops it)."""
    LighthouseServer = _lighthouse_server_class()

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
    """Run the lighthouse until SIGINT or SIGTERM, or until ``watch`` sees the run finished,
    printing the quorum's changes (``QuorumLog``)."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse logs every heartbeat at info
    server = start_lighthouse(options)
    address = address_of(options)
    print(f"lighthouse at {address} (min replicas {options.min_replicas}, heartbeat timeout "
          f"{options.heartbeat_timeout_ms} ms); replicas: --ft.lighthouse={address}"
          + (f"; exits when the {watch.replicas} group(s) in {watch.run_dir} finish" if watch else ""), flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    status_page, log = local_address_of(options), QuorumLog()
    while not stop.wait(poll_s):
        try:
            lines = log.update(read_status(status_page, timeout=poll_s), time.monotonic())
        except (OSError, ValueError):  # (a slow page: the next turn reads it)
            lines = []
        for line in lines:
            print(line, flush=True)
        if watch is not None and watch.finished():
            print(f"lighthouse: every replica group in {watch.run_dir} finished the run", flush=True)
            break
    server.shutdown()
