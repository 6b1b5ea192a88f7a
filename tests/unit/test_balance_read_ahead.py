"""The balancer's read-ahead in one process: its window, its close, its errors; and the
Balancer on it with a one-rank transport (the multi-rank protocol: tests/dist/test_balancer.py)."""

import threading
from types import SimpleNamespace

import numpy as np
import pytest

import freescale.balance.read_ahead as read_ahead
from freescale.balance.balancer import Balancer
from freescale.balance.cost import CostModel
from freescale.balance.read_ahead import CollectiveReadAhead
from freescale.config import SyntheticDataConfig
from freescale.data.synthetic import SyntheticSource


class Counting:
    """A producer that notes, as each item starts, how many items were taken by then."""

    def __init__(self, items=None, fail_at=None, gate: threading.Event | None = None, gate_from: int = 0) -> None:
        self.items, self.fail_at, self.gate, self.gate_from = items, fail_at, gate, gate_from
        self.started = 0
        self.taken_at_start = []
        self.ahead = None  # set once the read-ahead exists
        self.error = ValueError("the loader broke")

    def __call__(self):
        self.taken_at_start.append(self.ahead._taken if self.ahead else 0)
        i = self.started
        self.started += 1
        if self.gate is not None and i >= self.gate_from:
            self.gate.wait()
        if i == self.fail_at:
            raise self.error
        if self.items is not None and i >= self.items:
            raise StopIteration
        return i


def make(producer, depth, abort=lambda cause: None):
    ahead = CollectiveReadAhead(producer, depth, abort=abort, name="test-read-ahead")
    producer.ahead = ahead
    return ahead


def alive():
    return [t for t in threading.enumerate() if t.name == "test-read-ahead"]


@pytest.mark.parametrize("depth", [1, 3])
def test_items_come_in_order_and_the_thread_never_starts_more_than_depth_ahead(depth):
    producer = Counting()
    ahead = make(producer, depth)
    assert [next(ahead) for _ in range(10)] == list(range(10))
    ahead.close()
    # Item j starts only once item j - depth was taken (the window counts items taken).
    assert all(j - taken < depth for j, taken in enumerate(producer.taken_at_start))
    # Closed after 10 taken: the thread filled its window and stopped, exactly there.
    assert producer.started == 10 + depth
    assert not alive()


def test_close_lets_a_slow_thread_finish_its_window_so_every_rank_stops_at_the_same_item():
    """A thread behind the consumer's close (its peers' threads are further on) still starts
    what the window allows: ranks that took the same items made the same ones."""
    gate = threading.Event()
    producer = Counting(gate=gate, gate_from=1)  # item 1 on take a while
    ahead = make(producer, 3)
    assert next(ahead) == 0
    threading.Timer(0.2, gate.set).start()
    ahead.close()  # (the thread is inside item 1)
    assert producer.started == 1 + 3
    assert not alive()


def test_an_error_on_the_thread_is_raised_by_the_next_that_wants_that_item_as_itself():
    producer = Counting(fail_at=3)
    ahead = make(producer, 2)
    assert [next(ahead) for _ in range(3)] == [0, 1, 2]  # the items made before it come first
    with pytest.raises(ValueError) as caught:
        next(ahead)
    assert caught.value is producer.error
    assert any(frame.name == "__call__" for frame in caught.traceback)  # where it was raised, on the thread
    ahead.close()
    assert not alive()


def test_the_end_of_the_producer_ends_the_items():
    ahead = make(Counting(items=4), 2)
    assert list(ahead) == [0, 1, 2, 3]
    ahead.close()
    assert not alive()


def test_close_aborts_a_thread_that_waits_for_a_peer_that_never_comes(monkeypatch):
    """Closing with the thread inside a collective that no peer issues: after DRAIN_S it calls
    ``abort`` (the transport fails the wait) and the thread ends."""
    monkeypatch.setattr(read_ahead, "DRAIN_S", 0.2)
    released = threading.Event()

    def abort(cause):
        assert "did not stop" in cause
        released.set()

    def produce():
        released.wait()
        raise RuntimeError("the collective was aborted")

    ahead = CollectiveReadAhead(produce, 2, abort=abort, name="test-read-ahead")
    ahead.close()
    assert released.is_set() and not alive()
    with pytest.raises(StopIteration):
        next(ahead)


def test_close_before_anything_was_taken_stops_the_thread_after_the_window():
    producer = Counting()
    ahead = make(producer, 2)
    ahead.close()
    assert producer.started == 2 and not alive()


# The Balancer on the read-ahead, one rank ----------------------------------------------------------


class OneRank:
    """A transport of one rank: an all-gather or an all-to-all gives back what it was given."""

    rank, world_size = 0, 1

    def __init__(self) -> None:
        self.closed = False
        self.issued_on = set()  # the threads that issued collectives

    def _done(self, tensor):
        self.issued_on.add(threading.current_thread().name)
        return SimpleNamespace(wait=lambda: tensor.clone(), completed=lambda: True)

    def all_gather(self, tensor, sizes=None):
        return self._done(tensor)

    def all_to_all_single(self, tensor, input_splits, output_splits, lane=0):
        assert list(input_splits) == list(output_splits) == [len(tensor)]
        return self._done(tensor)

    def abort(self, cause="aborted"):
        pass

    def close(self):
        self.closed = True


def local_batches(count=None, fail_at=None):
    cfg = SyntheticDataConfig(median_uih_len=16, tail_prob=0.1, tail_min_len=200)
    src = SyntheticSource(cfg, seed=7, split="train", min_uih_len=1, max_uih_len=3000, num_candidates=3)
    k = 0
    while count is None or k < count:
        if k == fail_at:
            raise KeyError("sample 1234 is missing")
        yield k, src.samples_at(np.arange(8 * k, 8 * k + 8))
        k += 1


def test_the_balancer_runs_its_stages_on_its_own_thread_and_the_main_thread_only_takes(monkeypatch):
    import freescale.balance.balancer as module

    entered = []
    real = module.phase
    monkeypatch.setattr(module, "phase", lambda kind: entered.append((kind, threading.current_thread().name))
                        or real(kind))
    transport = OneRank()
    balancer = Balancer("hierarchical", CostModel(), transport, user_hash_size=100, normalize_loss=False)
    batches = balancer.batches(local_batches())
    got = [next(batches) for _ in range(3)]
    assert [int(b.batch_index) for b in got] == [0, 1, 2]
    assert entered and set(entered) == {("balance", "freescale-balancer")}
    assert transport.issued_on == {"freescale-balancer"}
    with pytest.raises(RuntimeError, match="while batches"):
        balancer.rebalance(next(local_batches())[1])
    balancer.close()
    assert transport.closed
    assert not [t for t in threading.enumerate() if t.name == "freescale-balancer"]


def test_a_loader_error_on_the_balancers_thread_is_raised_on_the_main_thread():
    balancer = Balancer("greedy", CostModel(), OneRank(), user_hash_size=100, normalize_loss=False, read_ahead=2)
    batches = balancer.batches(local_batches(fail_at=2))
    assert [int(next(batches).batch_index) for _ in range(2)] == [0, 1]
    with pytest.raises(KeyError, match="sample 1234 is missing"):
        next(batches)
    balancer.close()
    assert not [t for t in threading.enumerate() if t.name == "freescale-balancer"]


def test_a_finite_stream_ends_the_balanced_batches():
    balancer = Balancer("greedy", CostModel(), OneRank(), user_hash_size=100, normalize_loss=False)
    assert [int(b.batch_index) for b in balancer.batches(local_batches(count=3))] == [0, 1, 2]
    balancer.close()
