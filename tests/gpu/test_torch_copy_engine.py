"""``freescale.device.CopyEngine`` and ``staged_on_host`` on a CUDA GPU, both directions and
both lanes: copies wait for what they read, their readers wait for them, memory stays put while
a copy may use it, the directions and lanes do not queue behind each other, and no kernel runs.

As in ``test_torch_streams.py``, a stream is held busy by a spinning kernel so that a missing
wait or ``record_stream`` changes the result every time; each ordering test also runs a copy
made without the call (``without-it``), which must then be wrong.

Torch tier of the GPU check: torch and FreeScale's torch-only modules.
"""

import pytest
import torch

from freescale.device import CopyEngine, staged_on_host
from helpers.cuda import ELEMENTS, full, hold, settled

pytestmark = pytest.mark.gpu

TO_HOST, TO_DEVICE = CopyEngine.TO_HOST, CopyEngine.TO_DEVICE
LANES = pytest.mark.parametrize("high", [False, True], ids=["normal-lane", "high-lane"])
WITH_AND_WITHOUT = pytest.mark.parametrize("ordered", [True, False], ids=["with-the-call", "without-it"])


def _engine() -> CopyEngine:
    return CopyEngine(torch.device("cuda", torch.cuda.current_device()))


def _pinned(value: float) -> torch.Tensor:
    return torch.full((ELEMENTS,), value).pin_memory()


@LANES
@WITH_AND_WITHOUT
def test_a_copy_to_the_host_waits_for_what_the_callers_stream_wrote(high, ordered):
    engine = _engine()
    x, host = full(0.0), _pinned(-1.0)
    settled()
    hold()  # the caller's stream is busy ...
    x.fill_(1.0)  # ... then writes x
    if ordered:
        ready = engine.to_host(x, host, high=high)
    else:  # the engine's copy without its wait for the caller's stream
        stream = engine.streams[(TO_HOST, high)]
        with torch.cuda.stream(stream):
            host.copy_(x, non_blocking=True)
        ready = stream.record_event()
    ready.synchronize()
    assert torch.equal(host, torch.full((ELEMENTS,), 1.0 if ordered else 0.0))


@LANES
@WITH_AND_WITHOUT
def test_a_tensor_dropped_after_to_host_keeps_its_memory_until_the_copy_has_read_it(high, ordered):
    engine = _engine()
    host = _pinned(-1.0)
    settled()
    x = full(1.0)
    stream = engine.streams[(TO_HOST, high)]
    hold(stream)  # the copy waits behind this
    if ordered:
        ready = engine.to_host(x, host, high=high)
    else:  # the engine's calls without its record_stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            host.copy_(x, non_blocking=True)
        ready = stream.record_event()
    freed = x.data_ptr()
    del x
    w = full(2.0)  # the caller's next tensor of that size
    ready.synchronize()
    assert (w.data_ptr() == freed) is not ordered
    assert torch.equal(host, torch.full((ELEMENTS,), 1.0 if ordered else 2.0))


@LANES
@WITH_AND_WITHOUT
def test_the_callers_stream_waits_for_a_copy_to_the_device(high, ordered):
    engine = _engine()
    host, out = _pinned(3.0), full(0.0)
    settled()
    stream = engine.streams[(TO_DEVICE, high)]
    hold(stream)  # the copy waits behind this
    if ordered:
        out, done = engine.to_device(host, out.device, out=out, high=high)
    else:  # the copy without the caller's wait for its event
        with torch.cuda.stream(stream):
            out.copy_(host, non_blocking=True)
    z = out.clone()  # the caller reads at once
    torch.cuda.synchronize()
    assert torch.equal(z, full(3.0 if ordered else 0.0))


@LANES
@WITH_AND_WITHOUT
def test_a_copy_into_a_callers_tensor_waits_for_what_the_caller_issued_before(high, ordered):
    engine = _engine()
    host, out = _pinned(3.0), full(0.0)
    settled()
    hold()  # the caller's stream is busy ...
    z = out.clone()  # ... then reads out
    if ordered:
        engine.to_device(host, out.device, out=out, high=high)
    else:  # the copy without waiting for the caller's stream first
        stream = engine.streams[(TO_DEVICE, high)]
        with torch.cuda.stream(stream):
            out.copy_(host, non_blocking=True)
        torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    assert torch.equal(z, full(0.0 if ordered else 3.0))  # unordered, the copy overwrote it first
    assert torch.equal(out, full(3.0))


@LANES
@WITH_AND_WITHOUT
def test_a_tensor_the_engine_made_keeps_its_memory_until_the_callers_stream_has_read_it(high, ordered):
    engine = _engine()
    first, second = _pinned(5.0), _pinned(7.0)
    device = torch.device("cuda", torch.cuda.current_device())
    stream = engine.streams[(TO_DEVICE, high)]
    settled()
    hold()  # the caller's stream is busy
    if ordered:
        out, _ = engine.to_device(first, device, high=high)
    else:  # the engine's calls without its record_stream for the caller's stream
        with torch.cuda.stream(stream):
            out = first.to(device, non_blocking=True)
        torch.cuda.current_stream().wait_event(stream.record_event())
    z = out * 1  # the caller reads it once the hold is over
    freed = out.data_ptr()
    del out
    again, _ = engine.to_device(second, device, high=high)  # the engine's next tensor of that size
    torch.cuda.synchronize()
    assert (again.data_ptr() == freed) is not ordered
    assert torch.equal(z, full(5.0 if ordered else 7.0))


@pytest.mark.parametrize("busy,free", [((TO_DEVICE, False), (TO_HOST, False)), ((TO_HOST, False), (TO_DEVICE, False)),
                                       ((TO_HOST, False), (TO_HOST, True)), ((TO_DEVICE, False), (TO_DEVICE, True))],
                         ids=["to-host-beside-to-device", "to-device-beside-to-host", "high-beside-normal-to-host",
                              "high-beside-normal-to-device"])
def test_a_copy_does_not_queue_behind_the_other_direction_or_the_other_lane(busy, free):
    engine = _engine()
    x, host = full(1.0), _pinned(0.0)
    settled()
    hold(engine.streams[busy])  # a long copy in flight on the other stream
    direction, high = free
    if direction == TO_HOST:
        done = engine.to_host(x, host, high=high)
    else:
        _, done = engine.to_device(host, x.device, high=high)
    done.synchronize()
    assert not engine.streams[busy].query()  # complete while the other stream is still busy
    torch.cuda.synchronize()


def test_the_copy_engine_moves_a_device_tensor_to_pinned_memory_and_back_without_a_kernel():
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(1 << 20, device="cuda")
    engine = CopyEngine(x.device)
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for high in (False, True):
            engine.to_host(x, host, high=high).synchronize()
            back, done = engine.to_device(host, x.device, high=high)
            done.synchronize()
        torch.cuda.synchronize()
    assert torch.equal(host, x.cpu()) and torch.equal(back, x)
    on_device = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    assert any("memcpy" in n.lower() for n in on_device), on_device
    kernels = [n for n in on_device if "memcpy" not in n.lower() and "memset" not in n.lower()]
    assert kernels == [], kernels  # copies only: no streaming multiprocessor was used


def test_staged_on_host_runs_the_collective_on_a_host_copy_of_what_the_stream_wrote():
    engine = _engine()
    x = full(0.0)
    settled()
    hold()
    x.fill_(1.0)
    seen = []

    def collective(host):  # runs on the host, in place
        seen.append(host.clone())
        host.mul_(2.0)
        return "done"

    assert staged_on_host(x, collective, engine) == "done"
    z = x.clone()  # the caller's stream reads the result at once
    torch.cuda.synchronize()
    assert torch.equal(seen[0], torch.full((ELEMENTS,), 1.0)) and torch.equal(z, full(2.0))
