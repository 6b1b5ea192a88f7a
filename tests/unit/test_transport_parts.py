"""host_staged's parts in one process: the control wire, the scheduler's failure latch."""

import os
import socket
import threading
import time

import pytest
import torch

from freescale.transport.base import TransportError
from freescale.transport.host_staged.scheduler import Handle, Op, Scheduler
from freescale.transport.host_staged.wire import Kind, OpKey, Peer, PeerError, Wire


def _pair(timeout_s=0.3):
    a, b = socket.socketpair()
    a.setblocking(False)
    return Wire(0, {1: Peer(1, os.getpid(), a)}, timeout_s=timeout_s, spin_s=0.0), b


def test_messages_are_filed_by_sender_and_collective():
    mine, other_end = _pair()
    theirs = Wire(1, {0: Peer(0, os.getpid(), other_end)}, timeout_s=1.0, spin_s=0.0)
    other_end.setblocking(False)
    key = OpKey(lane=0, seq=7)
    mine.post(1, key, True, 4096)
    mine.want(1, OpKey(0, 8), file_id=3, fd=41, offset=128, nbytes=512)
    mine.done(1, key)
    mine.fail(OpKey(0, 9))
    theirs.wait(1.0)
    assert theirs.posted[(0, key)] == (True, 4096)
    assert theirs.wanted[(0, OpKey(0, 8))] == (3, 41, 128, 512)
    assert (0, key) in theirs.written
    assert theirs.peers[0].failed == OpKey(0, 9)
    with pytest.raises(PeerError, match="rank 0 failed an earlier collective"):
        theirs.check([0], OpKey(0, 10), pids=False)
    theirs.check([0], OpKey(0, 8), pids=False)  # a collective before the failed one still goes on
    assert [k.value for k in Kind] == [1, 2, 3, 4, 5]
    mine.close()
    theirs.close()


def test_a_peer_that_stops_taking_messages_fails_at_the_timeout():
    wire, other_end = _pair(timeout_s=0.3)  # the other end never reads
    t0 = time.monotonic()
    with pytest.raises(PeerError, match=r"rank 1 stopped taking messages for 0.3 s"):
        for seq in range(10**6):
            wire.bell(1, OpKey(0, seq))
    assert time.monotonic() - t0 < 5
    wire.close()
    other_end.close()


def test_interrupt_ends_every_wait_at_once():
    wire, other_end = _pair()
    wire.interrupt()
    t0 = time.monotonic()
    for _ in range(3):
        wire.wait(5.0)
    assert time.monotonic() - t0 < 1.0
    wire.close()
    other_end.close()


def _op(scheduler, name="all_gather"):
    out = torch.zeros(1)
    handle = Handle(name, lambda: out, scheduler.drive)
    return Op(key=scheduler.next_key(), handle=handle, ready=None, send=0, in_offsets=[0], in_bytes=[0], recv=0,
              out_offsets=[0], out_bytes=[0])


def test_a_failed_collective_latches_and_is_a_transport_error():
    told = []

    def run(op):
        if op.key.seq == 1:
            raise PeerError("rank 1 stopped taking messages for 0.3 s")

    scheduler = Scheduler(0, run=run, on_failure=lambda op: told.append(op.key))
    first, second, third = (_op(scheduler) for _ in range(3))
    for op in (first, second, third):
        scheduler.submit(op)
    assert first.handle.wait() is not None
    with pytest.raises(TransportError, match="host_staged all_gather: rank 1 stopped taking messages"):
        second.handle.wait()
    with pytest.raises(TransportError, match="an earlier collective failed: rank 1 stopped taking messages"):
        third.handle.wait()
    assert told == [OpKey(0, 1), OpKey(0, 2)]  # the peers hear of each failed collective
    assert scheduler.failed.startswith("rank 1 stopped taking messages")
    assert scheduler.close()


def test_abort_releases_a_waiter_while_its_collective_runs():
    started = threading.Event()
    release = threading.Event()

    def run(op):  # a collective stuck in a transfer nobody can interrupt
        started.set()
        release.wait(10)

    scheduler = Scheduler(0, run=run, on_failure=lambda op: None)
    stuck, queued = _op(scheduler), _op(scheduler)
    scheduler.submit(stuck)
    scheduler.submit(queued)
    assert started.wait(5)  # the proxy took it
    threading.Timer(0.2, scheduler.abort, args=("aborted by the replica manager",)).start()
    t0 = time.monotonic()
    for op in (stuck, queued):
        with pytest.raises(TransportError, match="aborted by the replica manager"):
            op.handle.wait()
    assert time.monotonic() - t0 < 2
    release.set()
    assert scheduler.close()
