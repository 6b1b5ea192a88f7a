"""``HostStagedTransport``: set-up, the interface, and one collective from start to end.

Set-up, on every rank of the group alike: exchange host names and pids; choose the way
between ranks on one host (``transport.local_path``: ``mapped`` if every rank may map its
peers' memory files, else ``shm_ring``; every rank takes the same); connect the control
wire; create and open the rings. Each step ends with every rank saying whether it succeeded,
so a step that fails on one rank fails on all of them, naming the rank and the cause,
instead of leaving the others in a barrier.

A collective: its tensor is checked (``base.check_*``), staged to pinned host memory on CUDA
(``staging``), given a result buffer from the pool (``memory``) and queued (``scheduler``).
Whoever runs it posts the transfers with other hosts (``remote``), moves the local part
(``local.LocalExchange``), sleeping on the wire between steps, and waits for the other
hosts. A peer whose connection ends, a peer whose process is gone, or no progress for
``timeout_s`` fails the collective; ``wait()`` raises ``TransportError`` naming the
operation, the peer and the cause, and the peers are told. A rank whose exchange completes
after a peer reported that collective failed fails it too: the peer may have sent its part
before it failed, but never received this rank's, and the ranks must agree.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import math
import os
import time
import uuid
import weakref
from typing import NamedTuple

import torch
import torch.distributed as dist

from freescale.errors import first_line
from freescale.transport.base import (NORMAL, TransportError, check_all_gather, check_all_to_all, check_lane,
                                      check_lanes)
from freescale.transport.host_staged import memory, wire
from freescale.transport.host_staged.local import LocalExchange
from freescale.transport.host_staged.remote import Pending, RemoteTransfers
from freescale.transport.host_staged.scheduler import Handle, Op, Scheduler
from freescale.transport.host_staged.staging import DeviceStaging, needs_staging

log = logging.getLogger("freescale")

FIRST_LOOK_S = 20e-6  # the first look again at a staging copy that was not complete
LOOK_EVERY_S = 1e-3  # and the longest wait between looks (the wait doubles up to it)


class HostStagedTransport:
    name = "host_staged"
    lane_has_threads = False
    """Lanes are rings and sequence numbers that the one proxy and the one gloo group serve."""

    def __init__(self, group: dist.ProcessGroup | None = None, cfg=None, lanes: int = 1) -> None:
        from freescale.config import TransportConfig

        cfg = cfg or TransportConfig(kind="host_staged")
        self.group = group or dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.chunk = cfg.chunk_kib * 1024
        self.slots = cfg.slots
        self.lanes = check_lanes(self.name, lanes)
        self.timeout_s = cfg.timeout_s
        self._global = [dist.get_global_rank(self.group, r) for r in range(self.world_size)]
        self._closed = False
        # Rings per lane and peer: a high-lane collective never waits for room behind a normal one.
        self.inbound: dict[int, dict[int, memory.Ring]] = {lane: {} for lane in range(lanes)}
        self.outbound: dict[int, dict[int, memory.Ring]] = {lane: {} for lane in range(lanes)}
        self._listener = None
        self._peers: dict[int, wire.Peer] = {}
        self.wire: wire.Wire | None = None
        self.scheduler: Scheduler | None = None
        self.pool: memory.BufferPool | None = None
        self.peer_files: memory.PeerFiles | None = None
        try:
            self._set_up(cfg)
        except BaseException:
            self._release()
            raise
        _LIVE.add(self)

    # Set-up --------------------------------------------------------------------------------

    def _set_up(self, cfg) -> None:
        probe = memory.probe_file()  # what peers map to test that they can: holds this rank's pid
        try:
            info = self._collective("exchanging host names", self._all_gather_object,
                                    (cfg.host_name or os.uname().nodename, os.getpid(), probe))
            host = info[self.rank][0]
            self.pids = [pid for _, pid, _ in info]
            self.local = [h == host for h, _, _ in info]
            token = uuid.uuid4().hex[:12] if self.rank == 0 else None
            self.prefix = f"freescale-{self._collective('agreeing on a name', self._broadcast_object, token)}"
            self.local_path = self._choose_local_path(cfg.local_path, info)
        finally:
            os.close(probe)

        peers = {r: self.pids[r] for r in range(self.world_size) if r != self.rank and self.local[r]}
        self._agree("listening for peers", self._listen, len(peers))
        self._agree("connecting the ranks of this host", self._connect, peers)
        # Rings with every peer on this host (mapped too: messages under a chunk go through them).
        self._agree("creating rings", self._create_rings, list(peers))
        self._agree("opening rings", self._open_rings, list(peers))
        self._agree("unlinking rings", self._unlink_rings)

        self.wire = wire.Wire(self.rank, self._peers, timeout_s=self.timeout_s, spin_s=cfg.spin_us * 1e-6)
        self.pool = memory.BufferPool(mapped=self.local_path == "mapped")
        self.peer_files = memory.PeerFiles(self.pids)
        self.staging = DeviceStaging(self.pool)
        remote = [r for r in range(self.world_size) if not self.local[r]]
        self.scheduler = Scheduler(self.rank, run=self._execute, on_failure=lambda op: self.wire.fail(op.key))
        self.scheduler.nudge = self.wire.nudge
        self.remote = RemoteTransfers(self.rank, remote, self._global, self.group, self.timeout_s, self.lanes,
                                      on_done=self.wire.nudge)
        here = sum(self.local) - 1
        log.info(f"host_staged: {here} peer(s) on this host ({host}, {self.local_path}), "
                 f"{len(remote)} on other hosts")

    def _choose_local_path(self, wanted: str, info: list) -> str:
        """``mapped`` if every rank can map its peers' memory files (and ``wanted`` allows it)."""
        problem = None
        if wanted != "shm_ring":
            for r in range(self.world_size):
                if r != self.rank and self.local[r]:
                    _, pid, fd = info[r]
                    problem = memory.can_map(self.rank, r, pid, fd)
                    if problem:
                        break
        problems = self._collective("probing memory files", self._all_gather_object, problem)
        first = next((p for p in problems if p), None)  # every rank decides alike
        if wanted == "mapped" and first:
            raise TransportError(f"host_staged: transport.local_path=mapped but {first}")
        return "shm_ring" if wanted == "shm_ring" or first else "mapped"

    def _listen(self, backlog: int) -> None:
        self._listener = wire.listen(self.prefix, self.rank, backlog)

    def _connect(self, peers: dict[int, int]) -> None:
        listener, self._listener = self._listener, None
        self._peers = wire.connect(listener, self.prefix, self.rank, peers, self.timeout_s)

    def _create_rings(self, peers: list[int]) -> None:
        for lane, rings in self.inbound.items():
            for src in peers:
                rings[src] = memory.create_ring(self._ring_name(lane, src, self.rank), self.chunk, self.slots)

    def _open_rings(self, peers: list[int]) -> None:
        for lane, rings in self.outbound.items():
            for dst in peers:
                rings[dst] = memory.open_ring(self._ring_name(lane, self.rank, dst), self.chunk, self.slots)

    def _unlink_rings(self) -> None:
        for rings in self.inbound.values():
            for ring in rings.values():
                memory.unlink(ring)

    def _ring_name(self, lane: int, src: int, dst: int) -> str:
        return f"{self.prefix}-{lane}-{src}-{dst}"

    def _agree(self, step: str, fn, *args) -> None:
        """Run ``fn`` here, then learn whether it succeeded on every rank; fail on all if not."""
        problem = None
        try:
            fn(*args)
        except Exception as e:
            problem = str(e) or type(e).__name__
        problems = self._collective(step, self._all_gather_object, problem)
        failed = [(r, p) for r, p in enumerate(problems) if p]
        if failed:
            where = "; ".join(f"rank {r}: {p}" for r, p in failed)
            raise TransportError(f"host_staged: set-up failed {step}: {where}")

    def _collective(self, step: str, fn, value):
        try:
            return fn(value)
        except RuntimeError as e:
            first = first_line(e)
            raise TransportError(f"host_staged: set-up failed {step} (rank {self.rank}): {first}") from e

    def _all_gather_object(self, value) -> list:
        out = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def _broadcast_object(self, value):
        box = [value]
        dist.broadcast_object_list(box, src=self._global[0], group=self.group)
        return box[0]

    # Interface -----------------------------------------------------------------------------

    def all_to_all_single(self, tensor: torch.Tensor, input_splits, output_splits, lane: int = NORMAL) -> Handle:
        tensor, ins, outs = check_all_to_all(self.name, self.rank, self.world_size, tensor, input_splits, output_splits)
        return self._submit("all_to_all_single", tensor, ins, outs, gather=False,
                            lane=check_lane(self.name, lane, self.lanes))

    def all_gather(self, tensor: torch.Tensor, sizes=None) -> Handle:
        tensor, sizes = check_all_gather(self.name, self.rank, self.world_size, tensor, sizes)
        return self._submit("all_gather", tensor, [tensor.shape[0]] * self.world_size, sizes, gather=True)

    def errored(self) -> Exception | None:
        failed = self.scheduler.failed
        return None if failed is None else TransportError(f"host_staged: {failed}")

    def abort(self, cause: str = "aborted") -> None:
        self.scheduler.abort(cause)
        self.wire.interrupt()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        if self.scheduler is not None:
            self.abort("the transport was closed")
            if not self.scheduler.close():
                return  # a thread is still inside a collective: leave its memory mapped
        self._release()
        if self.remote is not None:
            self.remote.close()
        self.remote = None  # holds the process group

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def _release(self) -> None:
        for rings in (*self.inbound.values(), *self.outbound.values()):
            for ring in rings.values():
                ring.close()
            rings.clear()
        if self._listener is not None:
            self._listener.close()
        if self.wire is not None:
            self.wire.close()
        else:
            for p in self._peers.values():
                p.sock.close()
        if self.pool is not None:
            self.pool.close()
        if self.peer_files is not None:
            self.peer_files.close()

    # One collective ------------------------------------------------------------------------

    def _submit(self, op: str, tensor: torch.Tensor, input_splits: list[int], output_splits: list[int],
                gather: bool, lane: int = NORMAL) -> Handle:
        if self._closed:
            raise TransportError(f"host_staged {op}: the transport is closed")
        if self.scheduler.failed:
            raise TransportError(f"host_staged {op}: an earlier collective failed: {self.scheduler.failed}")
        row_shape = tuple(tensor.shape[1:])
        row_bytes = tensor.element_size() * math.prod(row_shape)
        out_host = self.pool.take((sum(output_splits), *row_shape), tensor.dtype, pinned=needs_staging(tensor))
        high = lane > NORMAL
        src, ready = self.staging.to_host(tensor, high)
        finish = lambda: self.staging.to_device(out_host, tensor.device, high)  # noqa: E731
        in_bytes = [n * row_bytes for n in input_splits]
        out_bytes = [n * row_bytes for n in output_splits]
        item = Op(
            key=self.scheduler.next_key(lane), handle=Handle(op, finish, self.scheduler.drive), ready=ready,
            send=src.data_ptr(), in_bytes=in_bytes,
            # Every destination of an all-gather reads the same bytes: its offsets all start at 0.
            in_offsets=[0] * self.world_size if gather else [0, *itertools.accumulate(in_bytes)][:-1],
            recv=out_host.data_ptr(), out_bytes=out_bytes, out_offsets=[0, *itertools.accumulate(out_bytes)][:-1],
            keep=(tensor, src, out_host))
        self.scheduler.submit(item)
        return item.handle

    def _execute(self, op: Op) -> None:
        """Move one collective's bytes: peers on other hosts (posted first), peers on this host
        (stepped until done, sleeping on the wire between steps), then the other hosts' end.

        A higher lane's collective issued meanwhile is started here and stepped alongside, before
        this one each round; this returns once both are over. One is taken along at a time: a
        lane's rings carry one collective at a time.

        A collective whose input is still being copied to host memory (``op.ready``, on a GPU)
        is started once the copy's event says it is complete. The runner asks (``query()``)
        between rounds and never waits for the event, so the collectives it already runs keep
        moving meanwhile, and abort and the timeout apply as to any other wait; between looks
        it sleeps on the wire (a peer's message wakes it sooner), first ``FIRST_LOOK_S``, then
        twice as long each time up to ``LOOK_EVERY_S``: a short copy is seen soon, a long one
        costs a look a millisecond, not a core.
        """
        active: list[_Running] = []
        unstaged = [op]  # taken, but their input is not in host memory yet (higher lane first)
        along: Op | None = None  # the higher lane's collective taken along, until it is over
        deadline = time.monotonic() + self.timeout_s
        next_check = time.monotonic() + wire.CHECK_S
        look = FIRST_LOOK_S
        try:
            while active or unstaged:
                if along is None:
                    along = self.scheduler.take_passing(op.key.lane)
                    if along is not None:
                        unstaged.insert(0, along)
                progressed = False
                for item in list(unstaged):
                    if item.ready is None or item.ready.query():
                        unstaged.remove(item)
                        run = self._begin(item)
                        active.insert(len(active) if item is op else 0, run)
                        progressed = True
                        look = FIRST_LOOK_S
                for run in list(active):
                    progressed |= run.exchange.step()
                    if run.exchange.done:
                        # A peer that failed this collective may have sent its part before it failed:
                        # fail here too (as far as this rank has heard), so the ranks agree.
                        self.wire.wait(0.0)
                        self.wire.check_reports(self.wire.peers, run.op.key)
                        if not self.remote.finish(run.remote):
                            continue  # the other hosts' part is still on its way
                        progressed = True
                        active.remove(run)
                        if run.op is along:
                            self.scheduler.settle_passing(along)
                            along = None
                if not active and not unstaged:
                    break
                if any(item.handle.done.is_set() for item in [*(run.op for run in active), *unstaged]):  # aborted
                    raise RuntimeError(self.scheduler.failed or "aborted")
                now = time.monotonic()
                if progressed:
                    deadline = now + self.timeout_s
                if not progressed and now >= deadline:
                    if unstaged:
                        raise RuntimeError(f"this rank's input was not copied to host memory within "
                                           f"{self.timeout_s:g} s (the device has not reached the copy)")
                    waiting = sorted(set().union(*(run.exchange.waiting_for() for run in active)))
                    raise wire.PeerError(f"no progress for {self.timeout_s:g} s waiting for rank(s) {waiting}")
                for run in active:
                    self.wire.check(sorted(run.exchange.waiting_for()), run.op.key, pids=now >= next_check)
                if now >= next_check:
                    next_check = now + wire.CHECK_S
                if not progressed:
                    if unstaged:  # look at the copy again soon, without spinning meanwhile
                        self.wire.wait(min(look, max(0.0, deadline - now)), spin=False)
                        look = min(2 * look, LOOK_EVERY_S)
                    else:
                        # Rings full: look again soon. Another host's part pending: its waiter nudges the wire.
                        soon = any(run.exchange.ring_full for run in active)
                        self.wire.wait(0.001 if soon else min(wire.CHECK_S, max(0.0, deadline - now)))
        except BaseException as e:
            if along is not None:
                self.scheduler.settle_passing(along, e)
            raise

    def _begin(self, op: Op) -> "_Running":
        remote = self.remote.start(op)
        lane = op.key.lane
        exchange = LocalExchange(op, self.rank, self.wire, self.inbound[lane], self.outbound[lane], self.pool,
                                 self.peer_files, chunk=self.chunk, mapped=self.local_path == "mapped")
        exchange.start()
        return _Running(op, exchange, remote)


class _Running(NamedTuple):
    op: Op
    exchange: LocalExchange
    remote: "Pending"


_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Stop the proxies before the interpreter tears down (a proxy left running then can abort it)."""
    for t in list(_LIVE):
        t.close()
