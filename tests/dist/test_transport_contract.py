"""The transport contract on real ranks: input checks, close, abort, errored, and every failure
as a TransportError, for both transports where it applies."""

import json
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from freescale.config import TransportConfig
from freescale.transport.base import TransportError
from freescale.transport.registry import build_transport
from helpers.spawn import run_ranks

pytestmark = pytest.mark.slow

KINDS = ["torch_dist", "host_staged"]


def _build(kind, group=None, **kw):
    extra = dict(chunk_kib=4, slots=2) if kind == "host_staged" else {}
    return build_transport(TransportConfig(kind=kind, **extra, **kw), group)


def _bad_calls(rank, world):
    """(description, call, fragment of the error) for every local violation, on any world size."""
    even = [2] * world
    x = torch.arange(2.0 * world).reshape(2 * world, 1)  # 2 rows per rank
    own_off = list(even)
    own_off[rank] = 3
    calls = [
        ("too few rows for the splits", lambda t: t.all_to_all_single(x[:1], even, even),
         f"input_splits {even} sum to {2 * world} but the tensor has 1 rows"),
        ("more rows than the splits", lambda t: t.all_to_all_single(torch.cat([x, x]), even, even),
         f"sum to {2 * world} but the tensor has {4 * world} rows"),
        ("own share differs", lambda t: t.all_to_all_single(x, even, own_off),
         f"own share differs: input_splits[{rank}] = 2 but output_splits[{rank}] = 3"),
        ("one split too many", lambda t: t.all_to_all_single(x, even + [0], even),
         f"input_splits has {world + 1} entries, expected one per rank ({world})"),
        ("output splits too short", lambda t: t.all_to_all_single(x, even, even[:-1]),
         f"output_splits has {world - 1} entries"),
        ("negative split", lambda t: t.all_to_all_single(x, [-1] + [2] * (world - 1), even), "has a negative entry"),
        ("non-integer split", lambda t: t.all_to_all_single(x, [2.5] * world, even), "must be a list of integers"),
        ("0-d tensor", lambda t: t.all_to_all_single(torch.tensor(1.0), even, even), "0-d tensor"),
        ("unsupported dtype", lambda t: t.all_to_all_single(x.to(torch.complex64), even, even),
         "dtype complex64 is not supported"),
        ("gather sizes too long", lambda t: t.all_gather(x, [2 * world] * (world + 1)),
         f"sizes has {world + 1} entries"),
        ("gather own size wrong", lambda t: t.all_gather(x, [2 * world + 1] * world),
         f"sizes[{rank}] = {2 * world + 1} but the tensor has {2 * world} rows"),
        ("gather negative size", lambda t: t.all_gather(x[:0], [0] * (world - 1) + [-1] if rank != world - 1
                                                        else [-1] + [0] * (world - 1)),
         "has a negative entry"),
    ]
    if world == 1:  # what a user tried: 2 rows with [4]/[4], 4 rows with [1]/[3] and [3]/[1]
        four = torch.arange(4.0)
        calls += [
            ("2 rows, [4]/[4]", lambda t: t.all_to_all_single(four[:2], [4], [4]), "sum to 4 but the tensor has 2 rows"),
            ("4 rows, [1]/[3]", lambda t: t.all_to_all_single(four, [1], [3]), "sum to 1 but the tensor has 4 rows"),
            ("4 rows, [3]/[1]", lambda t: t.all_to_all_single(four, [3], [1]), "sum to 3 but the tensor has 4 rows"),
        ]
    return calls


def _malformed(rank, world, kind):
    t = _build(kind, timeout_s=10)
    for what, call, fragment in _bad_calls(rank, world):
        with pytest.raises(TransportError) as err:
            call(t)
        message = str(err.value)
        assert f"{kind} " in message and f"on rank {rank}: " in message, (what, message)
        assert fragment in message, (what, message)
        assert t.errored() is None, what  # refused locally: the transport stays usable
    # ... and then completes correct collectives, a non-contiguous input among them.
    rows = torch.arange(6 * world, dtype=torch.int64).reshape(2 * world, 3) + 100 * rank
    splits = [2] * world
    got = t.all_to_all_single(rows.t().contiguous().t(), splits, splits).wait()  # column-major: not contiguous
    want = torch.cat([torch.arange(6 * world).reshape(2 * world, 3)[2 * rank:2 * rank + 2] + 100 * r
                      for r in range(world)])
    assert torch.equal(got, want)
    gathered = t.all_gather(torch.full((rank + 1, 2), float(rank)), [r + 1 for r in range(world)]).wait()
    assert torch.equal(gathered, torch.cat([torch.full((r + 1, 2), float(r)) for r in range(world)]))
    t.close()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", [1, 2])
def test_malformed_input_is_refused_and_the_transport_goes_on(world, kind):
    run_ranks(world, _malformed, kind)


def _close_with_queued(rank, world, kind):
    t = _build(kind, dist.new_group(), timeout_s=30)  # its own group: the barriers below stay apart
    t.all_gather(torch.tensor([rank])).wait()
    if rank == 0:  # rank 1 has not issued these: they are queued or in flight when rank 0 closes
        handles = [t.all_gather(torch.tensor([float(i)])) for i in range(3)]
        time.sleep(0.2)
        t0 = time.monotonic()
        t.close()
        for h in handles:
            with pytest.raises(TransportError, match="the transport was closed"):
                h.wait()
        assert time.monotonic() - t0 < 30 / 5
        with pytest.raises(TransportError, match="closed"):
            t.all_gather(torch.tensor([0.0]))
        assert isinstance(t.errored(), TransportError)
    dist.barrier()
    if rank == 1:
        if kind == "host_staged":
            t0 = time.monotonic()  # its peer closed: told at once, not at the timeout
            with pytest.raises(TransportError, match=r"rank 0 (failed this collective|\(pid \d+\) closed its transport)"):
                t.all_gather(torch.tensor([0.0])).wait()
            assert time.monotonic() - t0 < 30 / 5
        else:  # the same group: rank 0's collectives are still in gloo, and these complete them
            for i in range(3):
                t.all_gather(torch.tensor([float(i)])).wait()
        t.close()


@pytest.mark.parametrize("kind", KINDS)
def test_close_fails_the_queued_collectives(kind):
    run_ranks(2, _close_with_queued, kind)


def _until_the_proxy_lets_go(t) -> None:
    """wait() on an aborted collective returns as soon as the abort settles the handle; the
    proxy running it tells the peers when it next looks at the latch, before it lets go."""
    deadline = time.monotonic() + 10
    while t.scheduler._running is not None and time.monotonic() < deadline:
        time.sleep(0.01)


def _abort(rank, world, kind):
    t = _build(kind, dist.new_group(), timeout_s=30)  # its own group: the barriers below stay apart
    t.all_gather(torch.tensor([rank])).wait()
    if rank == 0:
        running = t.all_to_all_single(torch.zeros(8), [4, 4], [4, 4])  # rank 1 never issues it
        queued = t.all_gather(torch.zeros(2))
        time.sleep(0.1)  # host_staged's proxy has taken the first one by now
        threading.Timer(0.3, t.abort, args=("replica 1 left the quorum",)).start()
        t0 = time.monotonic()
        for h in (running, queued):
            with pytest.raises(TransportError, match="replica 1 left the quorum"):
                h.wait()
        assert 0.25 < time.monotonic() - t0 < 30 / 5
        assert "replica 1 left the quorum" in str(t.errored())
        with pytest.raises(TransportError, match="replica 1 left the quorum"):
            t.all_gather(torch.zeros(1))  # refused at once, with the cause
        if kind == "host_staged":
            _until_the_proxy_lets_go(t)  # its part of `running` reached rank 1: the failure report must too
    dist.barrier()
    if rank == 1 and kind == "host_staged":
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="rank 0 failed this collective"):
            t.all_to_all_single(torch.zeros(8), [4, 4], [4, 4]).wait()
        assert time.monotonic() - t0 < 30 / 5
    if rank == 1 and kind == "torch_dist":
        t.all_to_all_single(torch.zeros(8), [4, 4], [4, 4]).wait()  # completes rank 0's abandoned ones in gloo
        t.all_gather(torch.zeros(2)).wait()
    t.close()


@pytest.mark.parametrize("kind", KINDS)
def test_abort_fails_every_pending_collective_at_once(kind):
    run_ranks(2, _abort, kind)


def _failed_after_sending(rank, world):
    t = _build("host_staged", dist.new_group(), timeout_s=30)
    t.all_gather(torch.tensor([rank])).wait()
    if rank == 0:
        sent = t.all_to_all_single(torch.zeros(8), [4, 4], [4, 4])
        time.sleep(0.1)  # the proxy has written this rank's part into rank 1's ring
    dist.barrier()
    if rank == 1:  # rank 0's part has arrived, announced, before this rank starts the collective
        t.wire.wait(0.0)
        assert t.wire.posted and t.wire.peers[0].failed is None
    dist.barrier()
    if rank == 0:  # ... and then rank 0 fails it, having never received rank 1's part
        t.abort("replica 1 left the quorum")
        with pytest.raises(TransportError, match="replica 1 left the quorum"):
            sent.wait()
        _until_the_proxy_lets_go(t)
    dist.barrier()
    if rank == 1:  # its exchange completes at its first step; it must still fail
        with pytest.raises(TransportError, match="rank 0 failed this collective"):
            t.all_to_all_single(torch.zeros(8), [4, 4], [4, 4]).wait()
    t.close()


def test_a_collective_that_a_peer_failed_after_sending_fails_here_too():
    """Both ranks must agree that it failed, however much of it had arrived."""
    run_ranks(2, _failed_after_sending)


def _closed_peer(rank, world):
    t = _build("host_staged", timeout_s=30)
    t.all_gather(torch.tensor([rank])).wait()
    if rank == 1:
        t.close()  # closes its transport, stays alive
    dist.barrier()
    if rank == 0:
        t0 = time.monotonic()
        with pytest.raises(TransportError, match=r"peer rank 1 \(pid \d+\) closed its transport"):
            t.all_to_all_single(torch.zeros(8), [4, 4], [4, 4]).wait()
        assert time.monotonic() - t0 < 30 / 5
        t.close()
    dist.barrier()


def test_peer_that_closed_its_transport_is_told_apart_from_a_dead_one():
    run_ranks(2, _closed_peer)


def _connect_timeout(rank, world):
    from freescale.transport.host_staged import wire

    if rank == 0:  # rank 0 dials rank 1 only after rank 1 has given up waiting
        dial = wire.dial

        def late(address, timeout_s):
            time.sleep(2.5)
            return dial(address, timeout_s)
        wire.dial = late
    t0 = time.monotonic()
    with pytest.raises(TransportError) as err:
        _build("host_staged", timeout_s=1.0)
    message = str(err.value)
    assert "host_staged: set-up failed connecting the ranks of this host" in message
    assert "rank 1: no connection from rank(s) [0] within 1 s" in message  # both ranks name both causes
    assert "rank 0: cannot connect to rank 1" in message
    assert time.monotonic() - t0 < 10
    if rank == 0:
        wire.dial = dial
    # Nothing was left behind: a new transport sets up and works.
    t = _build("host_staged", timeout_s=10)
    assert t.all_gather(torch.tensor([rank])).wait().tolist() == [0, 1]
    t.close()


def test_connect_timeout_fails_every_rank_with_a_transport_error():
    run_ranks(2, _connect_timeout)


def _lost_host(rank, world, marker):
    import types

    if rank == 2:  # says it runs on another host: its peers reach it over gloo
        os.uname = lambda: types.SimpleNamespace(nodename="elsewhere")
    t = _build("host_staged", timeout_s=30)
    t.all_gather(torch.tensor([rank])).wait()
    if rank == 2:
        os._exit(1)  # the other host goes away
    t0 = time.monotonic()
    with pytest.raises(TransportError) as failed:
        t.all_to_all_single(torch.zeros(30), [10, 10, 10], [10, 10, 10]).wait()
    with open(f"{marker}{rank}", "w") as f:
        f.write(json.dumps({"seconds": time.monotonic() - t0, "error": str(failed.value)}))
    os._exit(0)  # the group is broken; skip the harness's final barrier


def test_failed_cross_host_transfer_is_a_transport_error(tmp_path):
    marker = tmp_path / "rank"
    with pytest.raises(AssertionError):  # rank 2's exit is reported by the harness
        run_ranks(3, _lost_host, str(marker))
    seen = [json.loads((tmp_path / f"rank{r}").read_text()) for r in (0, 1)]
    assert all(s["seconds"] < 30 / 5 for s in seen), seen
    # The rank that sees the transfer fail first says so; it tells its peer, which may fail on
    # that report before its own transfer does (the ranks agree that the collective failed).
    assert any("a transfer with another host failed" in s["error"] for s in seen), seen
    assert all("a transfer with another host failed" in s["error"] or "failed this collective" in s["error"]
               for s in seen), seen
