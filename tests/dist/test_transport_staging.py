"""host_staged's wait for staging copies, on CPU through a staging whose copies the test
completes: a collective starts only once its copy says it is complete, the runner never
blocks on a copy (a normal collective in flight keeps moving while a high-lane one waits for
its copy), and a copy that never completes is subject to the timeout and to abort."""

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from freescale.config import TransportConfig
from freescale.transport.base import HIGH, TransportError
from freescale.transport.host_staged import HostStagedTransport
from helpers.spawn import run_ranks

pytestmark = pytest.mark.slow

UNCOPIED = -7  # what a staging buffer holds until its copy completes (inputs here are never negative)


class ControlledCopy:
    """A staging copy in flight: ``query()`` completes it (the bytes land in the buffer) once
    ``complete_when()`` says so. ``synchronize()`` is the blocking wait the runner must never make."""

    def __init__(self, host, data, complete_when):
        self.host, self.data, self.complete_when = host, data, complete_when
        self.looks = 0
        self.looked_at = threading.Event()
        self.done = False

    def query(self):
        self.looks += 1
        self.looked_at.set()
        if not self.done and self.complete_when():
            self.host.copy_(self.data)
            self.done = True
        return self.done

    def synchronize(self):
        raise AssertionError("the runner blocked on a staging copy")


class ControlledStaging:
    """Stages every tensor, CPU ones included, as a copy the test completes (``when``: a
    function that says, for each new copy, when it completes). Results come back as they are."""

    def __init__(self, when):
        self.when = when
        self.copies = []  # (copy, high) in the order the collectives were issued

    def to_host(self, tensor, high=False):
        host = torch.full_like(tensor, UNCOPIED)
        copy = ControlledCopy(host, tensor.clone(), self.when(len(self.copies)))
        self.copies.append((copy, high))
        return host, copy

    def to_device(self, host, device, high=False):
        return host


def _transport(local_path="auto", timeout_s=20.0, lanes=2):
    cfg = TransportConfig(kind="host_staged", local_path=local_path, chunk_kib=4, slots=2, timeout_s=timeout_s)
    return HostStagedTransport(dist.group.WORLD, cfg, lanes=lanes)


def _reference_all_to_all(data, splits):
    out = torch.empty_like(data)
    dist.all_to_all_single(out, data, splits, splits)
    return out


def _after_looks(n):
    """A copy that completes at the ``n``-th look."""
    def when(_):
        looks = [0]

        def complete():
            looks[0] += 1
            return looks[0] >= n
        return complete
    return when


def _starts_once_copied(rank, world, local_path):
    t = _transport(local_path)
    t.staging = ControlledStaging(_after_looks(3))
    try:
        rows = torch.arange(40, dtype=torch.int64).reshape(20, 2) + 100 * rank
        splits = [10, 10]
        got = t.all_to_all_single(rows, splits, splits).wait()
        assert torch.equal(got, _reference_all_to_all(rows, splits))  # not the uncopied buffer's bytes
        gathered = t.all_gather(rows[:3]).wait()
        ref = [torch.empty(3, 2, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(ref, rows[:3])
        assert torch.equal(gathered, torch.cat(ref))
        assert len(t.staging.copies) == 2 and all(copy.looks >= 3 for copy, _ in t.staging.copies)
    finally:
        t.close()


@pytest.mark.parametrize("local_path", ["mapped", "shm_ring"])
def test_a_collective_starts_once_its_staging_copy_is_complete(local_path):
    run_ranks(2, _starts_once_copied, local_path)


def _passing_waits_for_its_copy(rank, world, local_path):
    t = _transport(local_path)
    # 512 KiB: many ring chunks (or a direct write the receiver asks for), so a rank whose
    # runner stopped stepping it would hold up its peer's part of it too.
    big = torch.arange(1 << 16, dtype=torch.float64) + rank * 1e6
    small = torch.tensor([rank * 10.0 + j for j in range(world)])
    splits, ones = [big.numel() // world] * world, [1] * world
    if rank == 0:
        peer_finished_normal = threading.Event()
        # The normal one's copy completes at the first look (the runner has taken it); the high
        # one's only once the peer has received all of the normal one, which needs this rank's
        # runner to go on stepping the normal one while the high one waits for its copy.
        t.staging = ControlledStaging(lambda i: (lambda: True) if i == 0 else peer_finished_normal.is_set)
        normal = t.all_to_all_single(big, splits, splits)
        normal_copy = t.staging.copies[0][0]
        assert normal_copy.looked_at.wait(10)
        high = t.all_to_all_single(small, ones, ones, lane=HIGH)
        dist.barrier()  # the peer may issue its normal one
        dist.barrier()  # ... and has received all of it
        peer_finished_normal.set()
        got_high, got_normal = high.wait(), normal.wait()
        high_copy = t.staging.copies[1][0]
        assert high_copy.looks > 1  # it was looked at while it was not complete
        assert [high for _, high in t.staging.copies] == [False, True]  # the lane's copy streams
    else:
        dist.barrier()
        got_normal = t.all_to_all_single(big, splits, splits).wait()
        dist.barrier()
        got_high = t.all_to_all_single(small, ones, ones, lane=HIGH).wait()
    assert torch.equal(got_high, _reference_all_to_all(small, ones))
    assert torch.equal(got_normal, _reference_all_to_all(big, splits))
    t.close()


@pytest.mark.parametrize("local_path", ["mapped", "shm_ring"])
def test_a_high_lane_collective_waiting_for_its_copy_does_not_stall_the_normal_one_in_flight(local_path):
    run_ranks(2, _passing_waits_for_its_copy, local_path, timeout_s=120)


def _never_copied(rank, world):
    t = _transport(timeout_s=1.0, lanes=1)
    t.staging = ControlledStaging(lambda i: lambda: False)
    x = torch.arange(8)
    spins, sched_yield = [], os.sched_yield  # the wire spins with sched_yield() before it sleeps
    os.sched_yield = lambda: spins.append(1) or sched_yield()
    try:
        with pytest.raises(TransportError, match=r"input was not copied to host memory within 1 s"):
            t.all_gather(x).wait()
    finally:
        os.sched_yield = sched_yield
    (copy, _), = t.staging.copies
    # The runner sleeps between looks (at most one a millisecond after the first few), and
    # does not spin meanwhile: a runner that spun on query() would have looked hundreds of
    # thousands of times in 1 s, one that spun on the wire would have taken a core.
    assert 3 < copy.looks < 3000, copy.looks
    assert not spins
    with pytest.raises(TransportError, match="an earlier collective failed"):
        t.all_gather(x).wait()
    t.close()

    aborted = _transport(lanes=1)
    aborted.staging = ControlledStaging(lambda i: lambda: False)
    pending = aborted.all_gather(x)
    copy = aborted.staging.copies[0][0]
    looks_at_abort = []

    def abort():
        copy.looked_at.wait(10)
        aborted.abort("aborted by the replica manager")
        looks_at_abort.append(copy.looks)

    aborter = threading.Thread(target=abort)
    aborter.start()
    with pytest.raises(TransportError, match="aborted by the replica manager"):
        pending.wait()
    aborter.join()
    aborted.close()
    # Whichever thread ran it let go at its next look: it does not go on looking until the timeout.
    assert copy.looks - looks_at_abort[0] <= 2, (copy.looks, looks_at_abort)


def test_a_copy_that_never_completes_fails_at_the_timeout_or_on_abort_without_spinning():
    run_ranks(1, _never_copied, timeout_s=60)
