"""host_staged against the torch.distributed collective, on 2-4 gloo ranks in real processes;
what both transports do with bad input and failures."""

import glob
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from freescale.config import TransportConfig
from freescale.transport.base import HIGH, NORMAL, TransportError
from freescale.transport.registry import build_transport, lanes_for
from helpers.spawn import run_ranks

pytestmark = pytest.mark.slow

PATHS = ["mapped", "shm_ring"]


def _staged(local_path, **kw):
    """host_staged with small rings (shm_ring: messages of many chunks)."""
    return build_transport(TransportConfig(kind="host_staged", local_path=local_path, chunk_kib=4, slots=2, **kw))


def _random_splits(world, gen, zeros=True):
    """A world x world matrix of row counts; row i = what rank i sends; some zeros."""
    m = torch.randint(0, 9, (world, world), generator=gen)
    if zeros:
        m[torch.rand((world, world), generator=gen) < 0.3] = 0
    return m


def _compare(rank, world, local_path):
    staged = _staged(local_path, timeout_s=20)
    assert staged.local_path == local_path
    reference = build_transport(TransportConfig(kind="torch_dist"))
    gen = torch.Generator().manual_seed(1234)  # same on every rank: same split matrices
    cases = [(torch.float32, (5,)), (torch.int64, ()), (torch.bfloat16, (3, 4)), (torch.uint8, (700,))]
    for trial in range(6):
        for dtype, row in cases:
            m = _random_splits(world, gen, zeros=trial > 0)
            if trial == 5:
                m = m * 40  # rows of 700 bytes x 300: messages of many 4 KiB chunks
            input_splits, output_splits = m[rank].tolist(), m[:, rank].tolist()
            data = (torch.randn(sum(input_splits), *row, generator=torch.Generator().manual_seed(rank + 10 * trial)) * 100)
            data = data.to(dtype)
            want = reference.all_to_all_single(data, input_splits, output_splits).wait()
            got = staged.all_to_all_single(data, input_splits, output_splits).wait()
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got, want), (trial, dtype)
        # all_gather: equal and uneven sizes
        sizes = torch.randint(0, 50, (world,), generator=gen).tolist()
        mine = torch.arange(sizes[rank] * 3, dtype=torch.float64).reshape(sizes[rank], 3) + 1000 * rank
        assert torch.equal(staged.all_gather(mine, sizes).wait(), reference.all_gather(mine, sizes).wait())
        equal = torch.full((4, 2), rank, dtype=torch.int32)
        assert torch.equal(staged.all_gather(equal).wait(), reference.all_gather(equal).wait())
    # Results above 64 KiB: with `mapped`, peers write messages of a chunk or more straight in.
    big = torch.randint(0, 255, (world * 100_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(rank))
    even = [100_000] * world
    assert torch.equal(staged.all_to_all_single(big, even, even).wait(), reference.all_to_all_single(big, even, even).wait())
    if local_path == "mapped":
        assert staged.peer_files.peers() == set(range(world)) - {rank}
    # Several collectives in flight at once complete in order, whichever is waited for first.
    handles = [staged.all_gather(torch.tensor([rank * 10 + i])) for i in range(5)]
    for i in (4, 0, 2, 1, 3):
        assert handles[i].wait().tolist() == [r * 10 + i for r in range(world)]
    # A collective nobody waits for yet is moved by the proxy meanwhile (overlap with compute).
    pending = staged.all_to_all_single(big, even, even)
    deadline = time.monotonic() + 10
    while not pending.done.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pending.done.is_set()
    assert torch.equal(pending.wait(), reference.all_to_all_single(big, even, even).wait())
    # Collectives issued and waited for from another thread while this one goes on.
    x = torch.arange(64, dtype=torch.int64) + 100 * rank
    sends = [64 // world] * world
    sends[-1] += 64 - sum(sends)
    receives = [sends[rank]] * world
    with ThreadPoolExecutor(1) as pool:
        side = pool.submit(lambda: [staged.all_to_all_single(x, sends, receives).wait() for _ in range(20)]).result()
    want = reference.all_to_all_single(x, sends, receives).wait()
    assert all(torch.equal(got, want) for got in side)
    staged.close()


@pytest.mark.parametrize("local_path", PATHS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_host_staged_equals_torch_dist(world, local_path):
    run_ranks(world, _compare, local_path)


def _victim(rank, world, marker, local_path):
    staged = _staged(local_path, timeout_s=30)
    # Warm up: one collective that completes.
    staged.all_gather(torch.tensor([rank])).wait()
    if rank == 1:
        os._exit(1)  # dies mid-job, before the next collective
    t0 = time.monotonic()
    with pytest.raises(TransportError, match=r"host_staged all_to_all_single: peer rank 1 \(pid \d+\) died"):
        staged.all_to_all_single(torch.zeros(50000), [25000, 25000], [25000, 25000]).wait()
    with open(marker, "w") as f:
        f.write(f"{time.monotonic() - t0:.3f} {staged.prefix}")
    staged.close()
    os._exit(0)  # the group is broken; skip the harness's final barrier


@pytest.mark.parametrize("local_path", PATHS)
def test_dead_peer_fails_within_timeout_and_leaves_no_segments(tmp_path, local_path):
    marker = tmp_path / "rank0.txt"
    with pytest.raises(AssertionError):  # rank 1's exit is reported by the harness
        run_ranks(2, _victim, str(marker), local_path)
    elapsed, prefix = marker.read_text().split()
    assert float(elapsed) < 30.0 / 5  # the connection's end tells, not the 30 s timeout
    assert not glob.glob(f"/dev/shm/{prefix}*")


def _absent(rank, world, local_path):
    staged = _staged(local_path, timeout_s=1.0)
    staged.all_gather(torch.tensor([rank])).wait()
    if rank == 0:
        t0 = time.monotonic()
        with pytest.raises(TransportError, match=r"no progress for 1 s waiting for rank\(s\) \[1\]"):
            staged.all_to_all_single(torch.zeros(8), [4, 4], [4, 4]).wait()
        assert time.monotonic() - t0 < 5.0
        # The peers' state is unknown now: later collectives fail at once, naming the cause.
        with pytest.raises(TransportError, match="an earlier collective failed: no progress"):
            staged.all_gather(torch.tensor([rank])).wait()
    dist.barrier()  # rank 1 never issued the collective; it is alive all along
    staged.close()


@pytest.mark.parametrize("local_path", PATHS)
def test_peer_that_never_arrives_fails_at_the_timeout(local_path):
    run_ranks(2, _absent, local_path)


def _two_hosts(rank, world):
    import types

    if rank == 2:  # this rank says it runs on another host: its peers reach it over gloo
        os.uname = lambda: types.SimpleNamespace(nodename="elsewhere")
    staged = _staged("auto", timeout_s=20)
    assert staged.local == [rank != 2, rank != 2, rank == 2]
    reference = build_transport(TransportConfig(kind="torch_dist"))
    gen = torch.Generator().manual_seed(99)
    for trial in range(4):
        m = _random_splits(world, gen) * (1 if trial < 2 else 500)  # up to 4000 rows: large messages too
        data = torch.randn(int(m[rank].sum()), 3, generator=torch.Generator().manual_seed(rank + trial))
        got = staged.all_to_all_single(data, m[rank].tolist(), m[:, rank].tolist()).wait()
        assert torch.equal(got, reference.all_to_all_single(data, m[rank].tolist(), m[:, rank].tolist()).wait())
        sizes = torch.randint(0, 40, (world,), generator=gen).tolist()
        mine = torch.full((sizes[rank], 2), float(rank))
        assert torch.equal(staged.all_gather(mine, sizes).wait(), reference.all_gather(mine, sizes).wait())
    staged.close()


def test_peers_on_another_host_go_through_gloo():
    run_ranks(3, _two_hosts)


def _fallbacks(rank, world):
    from freescale.transport.host_staged import memory, scheduler

    if rank == 1:  # this rank may not map its peer's memory files (another user, say)
        def refuse(pid, fd):
            raise PermissionError(13, "Permission denied")
        memory.map_peer_file = refuse
    auto = _staged("auto")
    assert auto.local_path == "shm_ring"  # every rank takes the fallback, not only rank 1
    with pytest.raises(TransportError, match="local_path=mapped but rank 1 cannot map rank 0's memory: "
                                             "Permission denied"):
        _staged("mapped")
    # Without timerfd the proxy is woken at once for every collective; the results are the same.
    scheduler.Alarm.create = classmethod(lambda cls, seconds: None)
    woken = _staged("auto")
    x = torch.arange(6, dtype=torch.float64) + 10 * rank
    assert woken.all_gather(x).wait().tolist() == auto.all_gather(x).wait().tolist()
    pending = woken.all_gather(x)
    deadline = time.monotonic() + 10
    while not pending.done.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pending.wait().tolist() == [float(i + 10 * r) for r in range(world) for i in range(6)]
    auto.close()
    woken.close()


def test_fallback_to_rings_when_peers_cannot_map_each_other():
    run_ranks(2, _fallbacks)


def _mismatch(rank, world, width):
    staged = _staged("mapped", timeout_s=30)
    # Rank 0 sends rank 1 two rows; rank 1 expects one. Rows of `width` floats: 1 goes through
    # the rings, 1024 (8 KiB, more than the 4 KiB chunk) takes the large messages' protocol.
    sends = [[1, 2], [2, 2]][rank]
    receives = [[1, 2], [1, 2]][rank]
    t0 = time.monotonic()
    # Whichever rank sees the sizes first names them; the other learns that its peer failed
    # (in this collective, or at its next one when its own view was consistent and done).
    named = [f"rank 1 expects {4 * width} bytes but this rank sends {8 * width}",
             f"rank 0 sends {8 * width} bytes but this rank expects {4 * width}"][rank]
    with pytest.raises(TransportError, match=rf"{named} \(splits or sizes differ between ranks\)"
                                             rf"|rank {1 - rank} failed (this|an earlier) collective"):
        staged.all_to_all_single(torch.zeros(sum(sends), width), sends, receives).wait()
        staged.all_gather(torch.zeros(1)).wait()
    assert time.monotonic() - t0 < 10.0  # told by its peer, not left to the timeout
    staged.close()


@pytest.mark.parametrize("width", [1, 1024])
def test_mismatched_splits_fail_on_both_ranks(width):
    run_ranks(2, _mismatch, width)


def test_training_through_host_staged_matches_torch_dist(tmp_path):
    """The balancer's sample exchange through either transport trains to the same losses, and
    it did move samples: the ledger shows ranks training other than their contiguous slices,
    each sample of each global batch once."""
    import numpy as np

    from freescale.config import load_config
    from freescale.data.loader import build_sources
    from freescale.train.ledger import audit, read_ledger
    from helpers.launch import FAST, QUICKSTART, check, ranks, train_losses

    args = [*FAST, "--train.steps=5", "--balance.enable=true", "--balance.partition=karmarkar_karp",
            "--train.ledger=true"]
    losses, ledgers = {}, {}
    for kind in ("torch_dist", "host_staged"):
        run_dir = tmp_path / kind
        check(ranks(2, "train", "--config", str(QUICKSTART), *args, f"--run.dir={run_dir}",
                       f"--transport.kind={kind}"))
        losses[kind] = train_losses(run_dir)
        ledgers[kind] = read_ledger(run_dir)
    assert sorted(losses["host_staged"]) == [1, 2, 3, 4, 5]
    assert losses["host_staged"] == losses["torch_dist"]
    cfg = load_config(QUICKSTART, args)
    source, _ = build_sources(cfg.data, cfg.run.seed, task=cfg.task)
    batch = cfg.data.batch_size
    expected = {k: source.samples_at(np.arange(2 * batch * k, 2 * batch * (k + 1))).sample_ids.tolist() for k in range(5)}
    for kind, records in ledgers.items():
        assert audit(records, expected) == {"samples_lost": 0, "samples_repeated": 0, "unexpected": 0}, kind
        moved = [r for r in records if r["sample_ids"] != expected[r["batch"]][r["rank"] * batch:(r["rank"] + 1) * batch]]
        assert moved, f"{kind}: every rank trained its contiguous slice: nothing was balanced"
    key = lambda r: (r["step"], r["rank"])  # noqa: E731
    assert sorted(map(key, ledgers["host_staged"])) == sorted(map(key, ledgers["torch_dist"]))
    assert ({key(r): r["sample_ids"] for r in ledgers["host_staged"]}
            == {key(r): r["sample_ids"] for r in ledgers["torch_dist"]})


def _pool_reuse(rank, world):
    staged = build_transport(TransportConfig(kind="host_staged"))
    x = torch.arange(20000, dtype=torch.float32) + rank  # results above the size that skips the pool
    first = staged.all_gather(x).wait()
    kept = first.clone()
    ptr = first.data_ptr()
    second = staged.all_gather(x).wait()
    assert second.data_ptr() != ptr  # `first` is still held: its buffer is not handed out again
    assert torch.equal(first, kept)
    del first
    third = staged.all_gather(x).wait()
    assert third.data_ptr() == ptr  # released: reused
    assert torch.equal(third, kept)
    staged.close()


def test_results_reuse_only_released_buffers():
    run_ranks(2, _pool_reuse)


def _lanes(rank, world, kind, local_path):
    cfg = TransportConfig(kind=kind, local_path=local_path, chunk_kib=4, slots=2, timeout_s=10)
    t = build_transport(cfg, lanes=2)
    big = torch.arange(1 << 16, dtype=torch.float64) + rank * 1e9  # 512 KiB: many ring chunks, or mapped
    small = torch.tensor([rank * 10.0 + j for j in range(world)])
    splits, ones = [big.numel() // world] * world, [1] * world
    if rank == 0:
        # The big one is in flight (its peer has not issued it yet) when the small one is issued.
        normal = t.all_to_all_single(big, splits, splits)
        time.sleep(0.1)
        high = t.all_to_all_single(small, ones, ones, lane=HIGH)
        got_high = high.wait()
        assert not normal.completed()  # the small one passed it
        got_normal = normal.wait()
    else:
        # The peer issues the small one first, and the big one only once the small one is done.
        got_high = t.all_to_all_single(small, ones, ones, lane=HIGH).wait()
        time.sleep(0.2)
        got_normal = t.all_to_all_single(big, splits, splits).wait()
    ref_high, ref_normal = torch.empty_like(small), torch.empty_like(big)
    dist.all_to_all_single(ref_high, small)
    dist.all_to_all_single(ref_normal, big)
    assert torch.equal(got_high, ref_high) and torch.equal(got_normal, ref_normal)
    # Lanes are numbered per lane on every rank: issued in another order across lanes, they still pair up.
    order = [(HIGH, small + 100), (NORMAL, small)]
    handles = {lane: t.all_to_all_single(x, ones, ones, lane=lane)
               for lane, x in (order if rank == 0 else order[::-1])}
    assert handles[HIGH].wait().tolist() == [r * 10.0 + rank + 100 for r in range(world)]
    assert handles[NORMAL].wait().tolist() == [r * 10.0 + rank for r in range(world)]
    assert t.lanes == 2
    t.close()
    one = build_transport(cfg)  # what a caller reads to know it must not ask for HIGH
    assert one.lanes == 1
    with pytest.raises(TransportError, match="lane 1 does not exist"):
        one.all_to_all_single(small, [1] * world, [1] * world, lane=HIGH)
    one.close()
    with pytest.raises(ValueError, match="expected at least one lane, got lanes=0"):
        build_transport(cfg, lanes=0)


def _auto_lanes(rank, world):
    two = set(sorted(os.sched_getaffinity(0))[:2])
    cases = [  # (this rank's cores, its host's ranks), per rank -> lanes every rank builds
        ([(1, 1), (2, 1)], 1),  # one rank on a core of its own: one lane, on both (they must agree)
        ([(2, 1), (2, 1)], 2),
        ([(2, 2), (2, 2)], 1),  # two cores shared by two ranks of a host
    ]
    for per_rank, expected in cases:
        cores, local = per_rank[rank]
        os.sched_setaffinity(0, set(sorted(two)[:cores]))
        os.environ["LOCAL_WORLD_SIZE"] = str(local)
        lanes, why = lanes_for("auto", dist.group.WORLD, "torch_dist")
        assert lanes == expected, (per_rank, why)
        assert why.startswith("auto: ")
        # host_staged's lanes are rings its one proxy serves: no threads to take a core
        assert lanes_for("auto", dist.group.WORLD, "host_staged")[0] == 2
    assert lanes_for(2, dist.group.WORLD, "torch_dist") == (2, "transport.lanes")  # asked for: no cores counted
    assert lanes_for(1, dist.group.WORLD, "host_staged") == (1, "transport.lanes")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a process allowed on two cores or more")
def test_auto_lanes_are_two_unless_a_rank_has_one_core_for_a_lane_with_threads():
    run_ranks(2, _auto_lanes)


@pytest.mark.parametrize("kind,local_path", [("torch_dist", "auto"), ("host_staged", "shm_ring"),
                                             ("host_staged", "mapped")])
def test_a_high_priority_collective_passes_a_large_normal_one(kind, local_path):
    run_ranks(2, _lanes, kind, local_path)


def _two_high_while_normal_in_flight(rank, world):
    # shm_ring with 4 KiB chunks and 2 slots: a high-lane message of 3 chunks cannot be written
    # whole until the receiver reads, so a second high-lane collective issued meanwhile would
    # share the lane's ring with it if both were in flight (their chunks would interleave).
    cfg = TransportConfig(kind="host_staged", local_path="shm_ring", chunk_kib=4, slots=2, timeout_s=20)
    t = build_transport(cfg, lanes=2)
    big = torch.arange(1 << 14, dtype=torch.float64) + rank * 1e6
    highs = [torch.arange(3 * 512 * world, dtype=torch.float64) + 1e4 * (k + 1) + rank * 1e3 for k in range(2)]
    splits, thirds = [big.numel() // world] * world, [3 * 512] * world
    if rank == 1:
        normal = t.all_to_all_single(big, splits, splits)  # its peer issues it last: in flight throughout
        time.sleep(0.1)  # the proxy has taken it by now
        handles = [t.all_to_all_single(h, thirds, thirds, lane=HIGH) for h in highs]
        time.sleep(0.1)  # ... and the high ones issued while it runs
        dist.barrier()
        got = [h.wait() for h in handles]
        got_normal = normal.wait()
    else:
        dist.barrier()  # the peer's high-lane messages wait in the ring, as far as it holds them
        got = [t.all_to_all_single(h, thirds, thirds, lane=HIGH).wait() for h in highs]
        got_normal = t.all_to_all_single(big, splits, splits).wait()
    for mine, h in zip(got, highs):
        ref = torch.empty_like(h)
        dist.all_to_all_single(ref, h)
        assert torch.equal(mine, ref)
    ref = torch.empty_like(big)
    dist.all_to_all_single(ref, big)
    assert torch.equal(got_normal, ref)
    t.close()


def test_high_lane_collectives_issued_while_a_normal_one_runs_pass_it_one_at_a_time():
    run_ranks(2, _two_high_while_normal_in_flight)


def _lanes_across_hosts(rank, world):
    # Each rank names a host of its own, so every byte crosses over gloo point-to-point.
    t = build_transport(TransportConfig(kind="host_staged", host_name=f"host{rank}", timeout_s=10), lanes=2)
    assert t.local == [r == rank for r in range(world)]
    ones = [1] * world
    for trial in range(3):
        # Messages of the same size on both lanes. Rank 1's normal one is in flight (its
        # transfers posted) before it issues the high one; rank 0 issues the high one first and
        # the normal one only once the high one is done. Each must meet its own lane's
        # counterpart, and the high ones must complete while rank 1's normal one waits.
        mine = {lane: torch.tensor([1000.0 * lane + 100 * trial + 10 * rank + j for j in range(world)])
                for lane in (HIGH, NORMAL)}
        expect = {lane: [1000.0 * lane + 100 * trial + 10 * r + rank for r in range(world)] for lane in (HIGH, NORMAL)}
        if rank == 1:
            normal = t.all_to_all_single(mine[NORMAL], ones, ones)
            time.sleep(0.05)  # the proxy has taken it by now
            assert t.all_to_all_single(mine[HIGH], ones, ones, lane=HIGH).wait().tolist() == expect[HIGH]
            assert normal.wait().tolist() == expect[NORMAL]
        else:
            assert t.all_to_all_single(mine[HIGH], ones, ones, lane=HIGH).wait().tolist() == expect[HIGH]
            assert t.all_to_all_single(mine[NORMAL], ones, ones).wait().tolist() == expect[NORMAL]
    t.close()


def test_lanes_pair_up_across_hosts():
    run_ranks(2, _lanes_across_hosts)
