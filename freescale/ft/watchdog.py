"""The hang watchdog: a replica group that stops answering is given up in seconds, not after
the collective timeout.

A group that crashes closes its sockets, and the survivors' cross-replica collective with it
fails at once. A group that hangs (a stuck kernel, a frozen host, a swap storm, SIGSTOP) keeps
them open and says nothing: the survivors would wait in the collective for ``ft.timeout_s``.
A shorter timeout trades that stall for false alarms on slow steps; a heartbeat has no such
trade: every group's torchft manager (rank 0 of the group) beats to the lighthouse every
100 ms from a thread of torchft's own runtime, which beats through a slow step and stops only
when the process stops.

The protocol, one watchdog (a thread) per rank:

1. Ten times per ``ft.hang_timeout_s`` it reads the lighthouse's status page (``GET /status``:
   the id and members of the last quorum it formed, and how long ago it heard from each
   group: ``parse_status``).
2. ``verdict``: if that quorum is the one the rank's cross-replica process group was built for
   and a member has not been heard from for ``ft.hang_timeout_s``, the member is hung; if the
   lighthouse has formed a newer quorum without this group, the others went on without it.
   Either way the watchdog *gives the quorum up*.
3. A collective's wait on a quorum given up raises ``HungReplica``, which the replica layer
   takes as any failed collective: it reports the error and aborts the process group
   (``ReplicaLayer._allreduce``); the step is not committed and is trained again in the next
   quorum, which the lighthouse forms without the hung group (its own heartbeat timeout,
   500 ms, has passed by then). The collective itself stays behind in gloo's thread (gloo's
   abort does not interrupt an operation in flight): it ends when the hung group wakes or at
   its timeout, and writes only into the abandoned step's tensors.
4. A group whose own collective fails (a broken link, an error before it sent anything)
   aborts its process group, and also says so in the quorum's store (``ABORTED_KEY``, under
   the quorum's prefix): while a rank waits for a collective, its watchdog checks that key as
   often as it reads the lighthouse and gives the quorum up when it appears. Closing the
   group's sockets alone does not release the others: gloo wakes a peer's operation only where
   it waits on that very connection at that moment, so a group that posts its part just as the
   others close waits for ``ft.timeout_s``.
5. The vote fences a group that was itself stopped. torchft's vote asks the process group for
   an error (``errored()``), and the watched group answers one while its quorum is given up,
   or when the quorum is one it was in while the watchdog's own thread did not run for more
   than half of ``ft.hang_timeout_s`` (the process was stopped: the others may have given its
   step up, and its own collective may even complete as it wakes, the peers' abandoned halves
   being still in flight). It gives up none of its collectives for that (the others may still
   be waiting in one for its part), and a quorum built after it woke is not fenced. So a
   group that wakes fails the step it was stopped in, joins the next quorum behind the others
   and catches up from one of them. Voting against a step is always safe: when the peers did
   commit it with this group's batch, the catch-up says so (``ReplicaLayer._trained_by_peers``).

6. Building a quorum's process group is watched the same way: a group that dies or hangs after
   the quorum formed but before its ranks connected leaves the others' gloo build waiting for
   it, up to five connection tries of ``ft.timeout_s`` each (50 s at the default). A build
   whose quorum is given up raises ``HungReplica`` at once, so torchft's quorum fails the step
   (its group never built); the build goes on in its thread, and the group it may still make
   is kept and never used (``WatchedGloo``).

Every failed vote makes torchft's next quorum a new one (its id goes up), so a quorum given up
is never built on again.

Costs: one HTTP request to the lighthouse per rank every ``ft.hang_timeout_s / 10``, and a key
check in the quorum's store as often while the rank waits for a collective; a false
alarm (heartbeats late by ``ft.hang_timeout_s`` on an overloaded host, or a thread of the rank
kept off the interpreter for half of it) costs one step trained again. Not covered: some ranks
of a group hung while its rank 0 keeps beating, and a group that hangs while another fetches
its state (the fetch waits for ``ft.timeout_s``, as before).
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

from torch.distributed import Work
from torchft.process_group import ProcessGroupGloo, ProcessGroupWrapper

from freescale.ft.lighthouse import LighthouseStatus, group_of, read_status

log = logging.getLogger("freescale")

POLLS_PER_TIMEOUT = 10  # status reads (and abort-notice checks) per ft.hang_timeout_s
ABORTED_KEY = "freescale/aborted"
"""In a quorum's store (its prefix): the name of a group that aborted the quorum's collectives."""
ANNOUNCE_TRIES = 3  # (each failed connection to a store is a few lines of c10d's log)
STORE_RETRY_S = 1.5
"""The longest pause of c10d's TCPStore client between its two tries to connect (1 s, give or
take half): a store that is gone takes two connect timeouts and up to this to fail."""


class HungReplica(RuntimeError):
    """A cross-replica collective given up: a member of its quorum is hung, or this group was."""


def verdict(status: LighthouseStatus, quorum_id: int | None, group: str, hang_timeout_s: float) -> str:
    """Why this rank's quorum ``quorum_id`` is to be given up ("": it is not). ``group``: this
    group's name (``replica<g>``)."""
    if quorum_id is None or status.quorum_id is None:
        return ""
    if status.quorum_id == quorum_id:
        silent = [(m, status.heard[m]) for m in status.members if status.heard.get(m, 0.0) > hang_timeout_s]
        if silent:
            member, age = max(silent, key=lambda s: s[1])
            return (f"replica group {group_of(member)} of quorum {quorum_id} sent no heartbeat for {age:.1f} s "
                    f"(ft.hang_timeout_s {hang_timeout_s:g}): hung")
    elif status.quorum_id > quorum_id and group not in {group_of(m) for m in status.members}:
        return (f"the lighthouse formed quorum {status.quorum_id} without this group while it was in quorum "
                f"{quorum_id}: the others went on without it")
    return ""


class Watchdog:
    """One rank's watchdog (module docstring): ``watch`` wraps the cross-replica process group
    and starts the thread; ``close`` stops it."""

    def __init__(self, lighthouse: str, group: str, hang_timeout_s: float) -> None:
        self.lighthouse = lighthouse
        self.group = group
        self.hang_timeout_s = hang_timeout_s
        self.pg: WatchedProcessGroup | None = None
        self._given_up: dict[int, str] = {}  # quorum id -> why
        self._abandoned: list = []  # detached gloo groups (kept: see WatchedProcessGroup.abort)
        self._changed = threading.Condition()  # a quorum given up, or a watched collective done
        self._ran_at = time.monotonic()  # the thread's last turn
        self._turn_quorum: int | None = None  # the process group's quorum then
        self._stopped: dict[int, str] = {}  # quorums this process was stopped in -> why
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="freescale-watchdog", daemon=True)
        # The abort notices (module docstring, 4), on a thread of their own: a store that does
        # not answer (its host hung) delays them, never the lighthouse's verdicts. Every store
        # request is bounded by half of ft.hang_timeout_s, which close() outwaits.
        self._aborted: list[tuple[int, str, int]] = []  # (quorum id, its store, tries left) to be told
        self._store: tuple[str, object] | None = None  # (address, client) of the last store read
        self._waits = 0  # watched collectives being waited for
        self._wake = threading.Event()
        self._notices = threading.Thread(target=self._run_notices, name="freescale-watchdog-notices", daemon=True)

    def gloo(self, timeout: timedelta) -> WatchedGloo:
        """torchft's gloo process group, its builds watched (module docstring, 6)."""
        return WatchedGloo(self, timeout)

    def watch(self, pg) -> WatchedProcessGroup:
        self.pg = WatchedProcessGroup(pg, self)
        self._ran_at = time.monotonic()
        self._thread.start()
        self._notices.start()
        return self.pg

    def _run(self) -> None:
        while not self._stop.wait(self.hang_timeout_s / POLLS_PER_TIMEOUT):
            try:
                self._turn()
            except Exception as e:  # the watchdog never takes the rank down; the next turn tries again
                log.warning(f"hang watchdog: {str(e).splitlines()[0][:200]}")

    def _turn(self) -> None:
        now = time.monotonic()
        with self._changed:
            self._stopped.update(self._in_flight(now))
            self._ran_at, self._turn_quorum = now, self.pg.quorum_id
        timeout = self.hang_timeout_s / 2
        try:
            status = read_status(self.lighthouse, timeout=timeout)
        except (OSError, ValueError):
            status = None  # the lighthouse out of reach: the quorum says so
        finally:
            # A read that ended within its timeout (and a turn's pause) kept the thread running
            # all along: a slow lighthouse is no sign of this process stopped. One that took
            # longer was stopped in the middle, and the next turn sees the gap.
            ended = time.monotonic()
            if ended - now <= timeout + self.hang_timeout_s / POLLS_PER_TIMEOUT:
                with self._changed:
                    self._ran_at = ended
        if status is None:
            return
        quorum_id = self.pg.quorum_id
        cause = verdict(status, quorum_id, self.group, self.hang_timeout_s)
        if cause:
            self.give_up(quorum_id, cause)

    def announce_abort(self, quorum_id: int | None, store_addr: str | None) -> None:
        """Tell the quorum's other groups that this one aborted its collectives (module
        docstring, 4): the notices thread writes it, so the caller never waits on the store."""
        if quorum_id is None or store_addr is None:
            return
        with self._changed:
            self._aborted.append((quorum_id, store_addr, ANNOUNCE_TRIES))
        self._wake.set()

    def _run_notices(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.hang_timeout_s / POLLS_PER_TIMEOUT)
            self._wake.clear()
            try:
                self._notice_turn()
            except Exception as e:  # the store out of reach (its group died): the lighthouse says so
                self._store = None
                log.debug(f"hang watchdog: abort notices: {str(e).splitlines()[0][:200]}")

    def _notice_turn(self) -> None:
        with self._changed:
            aborted, self._aborted = self._aborted, []
            waiting = self._waits > 0
        for i, (quorum_id, store_addr, tries) in enumerate(aborted):
            try:
                self._client(store_addr).set(ABORTED_KEY, self.group)
            except Exception:
                with self._changed:  # (told again next turn: the store may be slow; not for ever: it may be gone)
                    self._aborted[:0] = [(q, a, t - 1) for q, a, t in aborted[i:] if t > 1]
                raise
        quorum_id, store_addr = self.pg.store
        if not waiting or quorum_id is None or store_addr is None or self.given_up(quorum_id):
            return
        store = self._client(store_addr)
        if store.check([ABORTED_KEY]):
            who = store.get(ABORTED_KEY).decode()
            if who != self.group:  # (this group's own notice: it failed the step already)
                self.give_up(quorum_id, f"replica group {who} aborted quorum {quorum_id}'s collectives")

    def _client(self, store_addr: str):
        """A client of the store at ``store_addr`` (``host:port/prefix``), kept while it is the
        one read."""
        if self._store is None or self._store[0] != store_addr:
            from torchft.process_group import create_store_client

            self._store = None
            self._store = (store_addr, create_store_client(store_addr, timedelta(seconds=self.hang_timeout_s / 2)))
        return self._store[1]

    def give_up(self, quorum_id: int | None, cause: str) -> None:
        """Fail every wait on ``quorum_id``'s collectives, and its vote."""
        if quorum_id is None:
            return
        with self._changed:
            if quorum_id not in self._given_up:
                self._given_up[quorum_id] = cause
                log.warning(f"giving up quorum {quorum_id}'s collectives: {cause}")
            self._changed.notify_all()

    def _in_flight(self, now: float) -> dict[int, str]:
        """The quorums this process was in while it did not run, if it did not run for more than
        half of ``ft.hang_timeout_s`` up to ``now`` (the others may have given them up): the one
        at the thread's last turn, and the current one unless it was built after the pause."""
        stopped = now - self._ran_at
        if stopped <= self.hang_timeout_s / 2:
            return {}
        why = f"this process did not run for {stopped:.1f} s (stopped?): the other groups may have given its step up"
        quorums = {self._turn_quorum} if self._turn_quorum is not None else set()
        if self.pg.configured_at < self._ran_at + 2 * self.hang_timeout_s / POLLS_PER_TIMEOUT:
            quorums.add(self.pg.quorum_id)
        return {q: why for q in quorums if q is not None}

    def cause(self, quorum_id: int | None) -> str:
        """Why a vote in ``quorum_id`` must fail ("": no reason the watchdog knows). A process that
        was stopped fails its vote in a quorum it was in, but gives up none of its collectives:
        the others may still wait in one for its part (they gave it up only after
        ``ft.hang_timeout_s``), which it sends as it wakes."""
        if quorum_id is None:
            return ""
        with self._changed:
            stopped = {**self._stopped, **self._in_flight(time.monotonic())}
            return self._given_up.get(quorum_id) or stopped.get(quorum_id, "")

    def wait(self, work, quorum_id: int | None):
        """``work.wait()``, unless ``quorum_id`` is given up first (``HungReplica``). The wait
        itself runs on a thread of its own, never a callback on gloo's thread: gloo's group joins
        its threads when torn down, holding the interpreter a callback would need."""
        with self._changed:
            self._waits += 1
        try:
            return self._unless_given_up(work.wait, quorum_id, "freescale-collective-wait")
        finally:
            with self._changed:
                self._waits -= 1

    def build(self, make, quorum_id: int | None):
        """``make()`` (a process group's build for ``quorum_id``), unless the quorum is given up
        first (``HungReplica``); a group the abandoned build makes later is kept (``abandon``)."""
        return self._unless_given_up(make, quorum_id, "freescale-group-build", keep_late=self.abandon)

    def _unless_given_up(self, call, quorum_id: int | None, name: str, keep_late=None):
        """``call()`` on a thread of its own, waited for until ``quorum_id`` is given up
        (``HungReplica``, the call left to end in its thread; what it returns then goes to
        ``keep_late``)."""
        outcome: list = []
        left: list = []  # set when the caller stopped waiting

        def run() -> None:
            try:
                result = (True, call())
            except Exception as e:
                result = (False, e)
            with self._changed:
                outcome.append(result)
                late = bool(left)
                self._changed.notify_all()
            if late and result[0] and keep_late is not None:
                keep_late(result[1])

        threading.Thread(target=run, name=name, daemon=True).start()
        with self._changed:
            while not outcome:
                if quorum_id in self._given_up:
                    left.append(True)
                    raise HungReplica(self._given_up[quorum_id])
                self._changed.wait()
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    def given_up(self, quorum_id: int | None) -> bool:
        """Whether this rank gave ``quorum_id``'s collectives up (a peer hung)."""
        with self._changed:
            return quorum_id in self._given_up

    def abandon(self, pg) -> None:
        """Keep a detached gloo group for the life of the rank (one per hang: a gloo context)."""
        self._abandoned.append(pg)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        # Out of any store or HTTP request before the interpreter ends (a thread inside c10d's
        # client then aborts the process): a turn ends within one store connection (two tries
        # of half of ft.hang_timeout_s and the pause between) and a read; twice that, for a busy host.
        for thread in (self._thread, self._notices):
            if thread.is_alive():
                thread.join(timeout=2 * (self.hang_timeout_s + STORE_RETRY_S))


class NullWatchdog:
    """``ft.hang_timeout_s: 0``: no watchdog, a hung group stalls the others for ``ft.timeout_s``."""

    def gloo(self, timeout: timedelta):
        return ProcessGroupGloo(timeout=timeout)

    def watch(self, pg):
        return pg

    def close(self) -> None:
        pass


class _WatchedWork(Work):
    def __init__(self, work, watchdog: Watchdog, quorum_id: int | None) -> None:
        super().__init__()
        self.work = work
        self.watchdog = watchdog
        self.quorum_id = quorum_id

    def wait(self, timeout=None) -> bool:
        return self.watchdog.wait(self.work, self.quorum_id)

    def get_future(self):
        return self.work.get_future()


class WatchedGloo(ProcessGroupGloo):
    """torchft's gloo process group whose build gives up with its quorum (module docstring, 6):
    torchft's ``configure`` assigns what ``_create_pg`` returns, so a build given up assigns
    nothing, and the group it may make later never replaces a newer quorum's."""

    def __init__(self, watchdog: Watchdog, timeout: timedelta) -> None:
        super().__init__(timeout=timeout)
        self.watchdog = watchdog

    def _create_pg(self, store, rank: int, world_size: int):
        make = super()._create_pg
        return self.watchdog.build(lambda: make(store, rank, world_size), self._quorum_id)


class WatchedProcessGroup(ProcessGroupWrapper):
    """The cross-replica process group under the watchdog: its collectives' waits give up with
    their quorum, and it reports the watchdog's cause as its error (which torchft's vote asks)."""

    def __init__(self, pg, watchdog: Watchdog) -> None:
        super().__init__(pg=pg)
        self.watchdog = watchdog
        self.configured_at = time.monotonic()
        self.store: tuple[int | None, str | None] = (None, None)
        """(quorum id, the quorum's store address) the group was last built for, set at once."""

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int, quorum_id: int | None = None,
                  *args, **kwargs) -> None:
        self.configured_at = time.monotonic()
        super().configure(store_addr, replica_id, rank, world_size, quorum_id, *args, **kwargs)
        self.store = (quorum_id, store_addr)

    @property
    def quorum_id(self) -> int | None:
        """The quorum the group was last built for (torchft's ``configure`` passes it through here)."""
        return self._quorum_id

    def _wrap_work(self, work, opts):
        return _WatchedWork(work, self.watchdog, self._quorum_id)

    def errored(self):
        cause = self.watchdog.cause(self._quorum_id)
        return HungReplica(cause) if cause else self.parent.errored()

    def abort(self, errored: bool = True) -> None:
        if not self.watchdog.given_up(self._quorum_id):
            # A collective failed on its own (or this process was stopped, which fails its vote
            # but gives up none of its collectives): the others are told, and the wrapped group
            # aborts, which releases a peer waiting on its sockets; this wrapper keeps wrapping it.
            self.watchdog.announce_abort(*self.store)
            self.parent.abort()
            return
        # Given up: the operation in flight waits for the hung group (until ft.timeout_s), and
        # so does gloo's group if it is aborted or torn down (its destructor joins its threads,
        # holding the interpreter). The group is detached (the next quorum's configure builds a
        # new one without touching it) and kept, never torn down while the rank lives.
        inner = self
        while isinstance(inner._pg, ProcessGroupWrapper):
            inner = inner._pg
        detached, inner._pg = inner._pg, None
        if detached is not None:
            self.watchdog.abandon(detached)

    def getBackendName(self) -> str:
        return self.parent.getBackendName()


def build_watchdog(ft, lighthouse: str):
    """A ``Watchdog`` for this rank, or a ``NullWatchdog`` with ``ft.hang_timeout_s: 0``."""
    if not ft.hang_timeout_s:
        return NullWatchdog()
    return Watchdog(lighthouse, f"replica{ft.replica_id}", ft.hang_timeout_s)
