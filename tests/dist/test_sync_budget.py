"""The pipelines over FreeScale's own tables never make the host wait for the device in a step,
counted on 2 gloo ranks (``helpers.syncs.SyncCounter``, which on CPU follows what would live on
a GPU).

The budget: nothing between the start of batch i's forward and the issue of its backward (in
between, the prioritized pipeline applies batch i-1's deferred gradients and issues batch
i+1's exclusive rows), and nothing in the rest of the step either: the routes, the collision
split, the flags, the counts and the masks are host tensors, and only positions go to the
device. The exchanges' waits are waits, not syncs: the counter does not see them.
"""

from contextlib import contextmanager

import pytest
import torch.distributed as dist

from freescale.profile.timeline import NullTimeline
from helpers.owned_tables import batches_of, build
from helpers.spawn import run_ranks
from helpers.syncs import SyncCounter

pytestmark = pytest.mark.slow

BUDGET = {"window": 0, "step": 0}
"""Syncs allowed per step: between the forward's start and the backward's issue, and in all."""
STEPS = 12


class MarkingTimeline(NullTimeline):
    """Puts the pipeline's spans among the counter's events, so the test sees where each sync was."""

    def __init__(self, counter):
        self.counter = counter

    def begin_step(self, step):
        self.counter.events.append(("step", step))

    def open(self, kind):
        self.counter.events.append(("open", kind))

    @contextmanager
    def span(self, kind):
        self.open(kind)
        yield

    def device_span(self, kind, stream):
        return self.span(kind)


class DeviceResults:
    """The pipeline's transport; a collective's result is the device's when what was sent was (a
    transport hands device tensors back for device tensors)."""

    def __init__(self, inner, counter):
        self.inner, self.counter = inner, counter
        self.rank, self.world_size = inner.rank, inner.world_size

    def all_to_all_single(self, tensor, ins, outs, lane=0):
        return _Result(self.inner.all_to_all_single(tensor, ins, outs, lane=lane), self.counter,
                       self.counter.on_device(tensor))

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _Result:
    def __init__(self, inner, counter, on_device):
        self.inner, self.counter, self.on_device = inner, counter, on_device

    def wait(self):
        out = self.inner.wait()
        return self.counter.mark(out) if self.on_device else out


def per_step(events):
    """{step: [(kind, what)]} of the counter's events, cut at each step's start."""
    steps, current = {}, None
    for kind, what in events:
        if kind == "step":
            current = steps.setdefault(what, [])
        elif current is not None:
            current.append((kind, what))
    return steps


def in_window(events):
    """The syncs from the forward's start to the backward's issue."""
    start = events.index(("open", "forward"))
    end = events.index(("open", "backward"), start)
    return [what for kind, what in events[start:end] if kind == "sync"]


def _count(rank, world, mode, transport_kind, device="cpu"):
    if device == "cuda":
        import torch

        torch.cuda.set_device(0)  # both ranks share the one GPU (gloo and host_staged)
    counter = SyncCounter(device=device)
    model, _, pipeline = build(mode, rank, world, transport_kind, MarkingTimeline(counter), device=device)
    counter.follow(model)
    pipeline.inner.transport = DeviceResults(pipeline.inner.transport, counter)
    batches = iter(batches_of(rank)[:STEPS + 2])
    with counter:
        for step in range(1, STEPS + 1):
            pipeline.inner.timeline.begin_step(step)
            pipeline.progress(batches)
    # Every rank through its steps before a transport closes, as the trainer ends: the next
    # batch's rows are already on their way, and a closing transport aborts what is in flight
    # (a peer still in its last step would find that collective failed).
    dist.barrier()
    pipeline.close()
    steps = per_step(counter.events)
    assert sorted(steps) == list(range(1, STEPS + 1))
    # Every step has a forward and a backward, and the device's tensors were followed (the
    # counter saw the rows and the model's parameters as the device's).
    assert all(("open", "forward") in e and ("open", "backward") in e for e in steps.values())
    assert counter.on_device(next(model.task.parameters()))
    for step, events in steps.items():
        window = in_window(events)
        syncs = [what for kind, what in events if kind == "sync"]
        assert len(window) <= BUDGET["window"], (mode, step, window)
        assert len(syncs) <= BUDGET["step"], (mode, step, syncs)


@pytest.mark.parametrize("mode, transport_kind", [("prioritized", "torch_dist"), ("prioritized", "host_staged"),
                                                  ("sync", "torch_dist")])
def test_a_step_never_waits_for_the_device(mode, transport_kind):
    run_ranks(2, _count, mode, transport_kind)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["prioritized", "sync"])
def test_on_the_gpu_a_step_never_waits_for_the_device(mode):
    # On CUDA the counter sees where tensors really are; what fbgemm's kernels do inside is
    # noted apart ("library sync") and not FreeScale's to budget.
    run_ranks(2, _count, mode, "host_staged", "cuda")


def _counts_a_read_back(rank, world):
    """The counter sees a value read back from the device inside the window (the check can say no)."""
    counter = SyncCounter()
    model, _, pipeline = build("prioritized", rank, world, "torch_dist", MarkingTimeline(counter))
    counter.follow(model)
    inner = pipeline.inner
    send = inner._send_exclusive_rows

    def reading_back(nxt):  # what the pipeline did before the routes moved to the host
        send(nxt)
        nxt.looked_up.detach().sum(dim=1).tolist()

    inner._send_exclusive_rows = reading_back
    batches = iter(batches_of(rank)[:5])
    with counter:
        for step in (1, 2, 3):
            inner.timeline.begin_step(step)
            pipeline.progress(batches)
    pipeline.close()
    windows = [in_window(events) for events in per_step(counter.events).values()]
    assert len(windows) == 3 and all(len(w) == 1 and w[0].startswith("tolist at ") for w in windows), windows


def test_the_budget_check_sees_a_value_read_back_in_the_window():
    run_ranks(2, _counts_a_read_back)
