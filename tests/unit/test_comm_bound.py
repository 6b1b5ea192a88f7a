"""The exposed-communication bound against hand computations."""

import pytest

from freescale.profile.comm_bound import add_bounds, exposed_comm_bound_ms, link_ms

# On a 1 Gbit/s link a millisecond moves 125,000 bytes.
MS = 125_000


def test_a_millisecond_of_a_gigabit_link_moves_125_kb():
    assert link_ms(MS, 1.0) == pytest.approx(1.0)
    assert link_ms(MS, 4.0) == pytest.approx(0.25)


def test_the_collision_exchange_is_exposed_in_full_and_the_rest_beyond_the_compute():
    # 4 ms of exchange of which 1 ms collision rows: with 2 ms of compute, 1 + (3 - 2) = 2 ms.
    assert exposed_comm_bound_ms(4 * MS, 1 * MS, compute_ms=2.0, link_gbit=1.0) == pytest.approx(2.0)
    # Compute longer than the rest hides all of it: the collision rows alone.
    assert exposed_comm_bound_ms(4 * MS, 1 * MS, compute_ms=5.0, link_gbit=1.0) == pytest.approx(1.0)
    # No collision rows and no compute: the whole exchange. At 2 Gbit/s, half the time.
    assert exposed_comm_bound_ms(4 * MS, 0, compute_ms=0.0, link_gbit=1.0) == pytest.approx(4.0)
    assert exposed_comm_bound_ms(4 * MS, 0, compute_ms=0.0, link_gbit=2.0) == pytest.approx(2.0)
    # Every row a collision row: nothing is left to hide.
    assert exposed_comm_bound_ms(4 * MS, 4 * MS, compute_ms=10.0, link_gbit=1.0) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="positive Gbit/s"):
        exposed_comm_bound_ms(MS, 0, compute_ms=1.0, link_gbit=0.0)


def test_runs_without_bytes_take_those_of_the_runs_of_the_same_batches():
    prioritized = {"exposed_comm_ms": 2.5, "compute_ms": 2.0, "exchange_bytes": 4 * MS, "collision_bytes": 1 * MS}
    sync = {"exposed_comm_ms": 6.0, "compute_ms": 1.0, "exchange_bytes": 4 * MS, "collision_bytes": None}
    torchrec = {"exposed_comm_ms": 7.0, "compute_ms": 3.0, "exchange_bytes": None, "collision_bytes": None}
    add_bounds([prioritized, sync, torchrec], link_gbit=1.0)
    # Each with its own compute: 1 + (3 - 2), 1 + (3 - 1), 1 + 0.
    assert [r["bound_ms"] for r in (prioritized, sync, torchrec)] == pytest.approx([2.0, 3.0, 1.0])
    assert [r["exposed_minus_bound_ms"] for r in (prioritized, sync, torchrec)] == pytest.approx([0.5, 3.0, 6.0])
    assert [r["bytes_borrowed"] for r in (prioritized, sync, torchrec)] == [False, True, True]
    assert torchrec["exchange_bytes"] == 4 * MS and sync["collision_bytes"] == MS


def test_no_bound_without_a_link_or_without_bytes():
    run = {"exposed_comm_ms": 2.0, "compute_ms": 1.0, "exchange_bytes": MS, "collision_bytes": 0}
    add_bounds([run], link_gbit=None)
    assert run["bound_ms"] is None and run["exposed_minus_bound_ms"] is None
    alone = {"exposed_comm_ms": 2.0, "compute_ms": 1.0, "exchange_bytes": MS, "collision_bytes": None}
    add_bounds([alone], link_gbit=1.0)
    assert alone["bound_ms"] is None
