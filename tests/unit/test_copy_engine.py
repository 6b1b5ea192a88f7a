"""The copy engine and the transport's staging on CPU, through a device module that records:
which stream each copy runs on, what it waits for, where the streams were made."""

from contextlib import contextmanager

import pytest
import torch

from freescale.device import CopyEngine
from freescale.transport.host_staged.staging import DeviceStaging

TO_HOST, TO_DEVICE = CopyEngine.TO_HOST, CopyEngine.TO_DEVICE


class RecordingCuda:
    """A device module whose streams, events and stream contexts log what is asked of them.

    The current device is ``cuda:0`` and the current stream ``compute`` until a ``stream``
    context changes it; ``Stream`` takes ``device`` and ``priority`` as torch.cuda's does and
    its ``priority_range()`` is (0, -3), what torch gives on a current GPU.
    """

    def __init__(self):
        self.log = []
        self.made = []
        self.current = FakeStream(self, "compute", device=torch.device("cuda", 0), priority=0)
        self.Stream = _StreamClass(self)

    def current_device(self):
        return 0

    def current_stream(self, device=None):
        return self.current

    @contextmanager
    def stream(self, stream):
        before, self.current = self.current, stream
        self.log.append(("enter", stream.name))
        try:
            yield
        finally:
            self.current = before
            self.log.append(("exit", stream.name))

    def Event(self, enable_timing=False, blocking=False):
        return FakeEvent(self, blocking)


class _StreamClass:
    def __init__(self, cuda):
        self.cuda = cuda

    def __call__(self, device=None, priority=0):
        stream = FakeStream(self.cuda, f"s{len(self.cuda.made)}", device=device, priority=priority)
        self.cuda.made.append(stream)
        return stream

    @staticmethod
    def priority_range():
        return 0, -3


class FakeStream:
    def __init__(self, cuda, name, device, priority):
        self.cuda, self.name, self.device, self.priority = cuda, name, device, priority

    def wait_stream(self, other):
        self.cuda.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event):
        self.cuda.log.append(("wait_event", self.name, event.name))


class FakeEvent:
    def __init__(self, cuda, blocking):
        self.cuda, self.blocking = cuda, blocking
        self.name = f"e{sum(1 for entry in cuda.log if entry[0] == 'record')}"

    def record(self, stream):
        self.cuda.log.append(("record", self.name, stream.name))

    def query(self):
        return True


class DeviceTensor:
    """CPU bytes that say they live on ``device``: what the engine does with them is logged
    (the copy with the stream it was issued on, ``record_stream``)."""

    def __init__(self, cuda, name, data, device):
        self.cuda, self.name, self.data, self.device = cuda, name, data, torch.device(device)
        self.shape, self.dtype = data.shape, data.dtype

    def copy_(self, src, non_blocking=False):
        self.cuda.log.append(("copy", self.cuda.current.name))
        self.data.copy_(src.data)
        return self

    def to(self, device, non_blocking=False):
        self.cuda.log.append(("copy", self.cuda.current.name))
        return DeviceTensor(self.cuda, "out", self.data.clone(), device)

    def record_stream(self, stream):
        self.cuda.log.append(("record_stream", self.name, stream.name))


def _engine(device="cuda:1"):
    cuda = RecordingCuda()
    return CopyEngine(device, module=cuda), cuda


def test_copy_streams_are_made_on_the_engines_device_one_per_direction_and_lane_the_high_lane_first():
    engine, cuda = _engine("cuda:1")  # not the current device (cuda:0)
    streams = engine.streams
    assert sorted(streams) == [(TO_DEVICE, False), (TO_DEVICE, True), (TO_HOST, False), (TO_HOST, True)]
    assert len({id(s) for s in streams.values()}) == 4  # no copy queues behind another direction's or lane's
    assert all(s.device == torch.device("cuda", 1) for s in streams.values())
    assert [streams[(d, True)].priority for d in (TO_HOST, TO_DEVICE)] == [-3, -3]  # the highest torch gives
    assert [streams[(d, False)].priority for d in (TO_HOST, TO_DEVICE)] == [0, 0]
    assert CopyEngine("cuda", module=RecordingCuda()).device == torch.device("cuda", 0)  # no index: the current one


@pytest.mark.parametrize("high", [False, True])
def test_a_copy_to_the_host_waits_for_the_callers_stream_runs_on_its_direction_and_lanes_stream(high):
    engine, cuda = _engine()
    stream = engine.streams[(TO_HOST, high)].name
    x = DeviceTensor(cuda, "x", torch.arange(6.0), "cuda:1")
    host = DeviceTensor(cuda, "host", torch.zeros(6), "cpu")
    ready = engine.to_host(x, host, high=high)
    assert torch.equal(host.data, x.data)
    assert cuda.log == [("wait_stream", stream, "compute"), ("enter", stream), ("copy", stream), ("exit", stream),
                        ("record", ready.name, stream), ("record_stream", "x", stream)]
    assert not ready.blocking
    assert engine.to_host(x, host, blocking=True).blocking  # a thread that waits at once sleeps


@pytest.mark.parametrize("high", [False, True])
def test_a_copy_to_the_device_runs_on_its_own_stream_and_the_callers_stream_waits_for_its_event(high):
    engine, cuda = _engine()
    stream = engine.streams[(TO_DEVICE, high)].name
    host = DeviceTensor(cuda, "host", torch.arange(4.0), "cpu")
    out, done = engine.to_device(host, torch.device("cuda", 1), high=high)
    assert torch.equal(out.data, host.data) and out.device == torch.device("cuda", 1)
    assert cuda.log == [("enter", stream), ("copy", stream), ("exit", stream), ("record", done.name, stream),
                        ("wait_event", "compute", done.name), ("record_stream", "out", "compute")]
    # Into a tensor the caller gives, the copy first waits for what the caller's stream issued
    # before (it may still read that tensor).
    cuda.log.clear()
    into = DeviceTensor(cuda, "into", torch.zeros(4), "cuda:1")
    out, done = engine.to_device(host, torch.device("cuda", 1), out=into, high=high)
    assert out is into and torch.equal(into.data, host.data)
    assert cuda.log == [("wait_stream", stream, "compute"), ("enter", stream), ("copy", stream),
                        ("record_stream", "into", stream), ("exit", stream), ("record", done.name, stream),
                        ("wait_event", "compute", done.name), ("record_stream", "into", "compute")]


def test_an_engine_refuses_a_tensor_of_another_device():
    engine, cuda = _engine("cuda:1")
    x = DeviceTensor(cuda, "x", torch.zeros(2), "cuda:0")
    with pytest.raises(ValueError, match="copy engine on cuda:1 was given a tensor on cuda:0"):
        engine.to_host(x, DeviceTensor(cuda, "host", torch.zeros(2), "cpu"))
    with pytest.raises(ValueError, match="one engine per device"):
        engine.to_device(DeviceTensor(cuda, "host", torch.zeros(2), "cpu"), torch.device("cuda", 0))


class _Pool:
    """Pinned buffers as CPU tensors that the recording module can log."""

    def __init__(self, cuda):
        self.cuda = cuda

    def take(self, shape, dtype, pinned):
        assert pinned
        return DeviceTensor(self.cuda, "host", torch.empty(shape, dtype=dtype), "cpu")


def test_staging_copies_with_the_engine_of_the_tensors_device_on_the_lanes_streams():
    cuda = RecordingCuda()
    staging = DeviceStaging(_Pool(cuda), engine=lambda device: CopyEngine(device, module=cuda))
    on_1 = DeviceTensor(cuda, "x", torch.arange(3.0), "cuda:1")
    on_2 = DeviceTensor(cuda, "y", torch.arange(3.0), "cuda:2")
    staging.to_host(on_1)
    staging.to_host(on_2, high=True)
    staging.to_host(on_1)
    engines = {device: staging.engine(torch.device(device)) for device in ("cuda:1", "cuda:2")}
    assert [e.device for e in engines.values()] == [torch.device("cuda", 1), torch.device("cuda", 2)]
    assert len(cuda.made) == 8  # one engine per device, made once
    copies = [entry[1] for entry in cuda.log if entry[0] == "copy"]
    assert copies == [engines["cuda:1"].streams[(TO_HOST, False)].name, engines["cuda:2"].streams[(TO_HOST, True)].name,
                      engines["cuda:1"].streams[(TO_HOST, False)].name]
    cuda.log.clear()
    out = staging.to_device(DeviceTensor(cuda, "host", torch.ones(3), "cpu"), torch.device("cuda", 2), high=True)
    assert out.device == torch.device("cuda", 2)
    assert ("copy", engines["cuda:2"].streams[(TO_DEVICE, True)].name) in cuda.log
    # A CPU tensor passes through: nothing to copy, nothing to wait for.
    cpu = torch.arange(3)
    assert staging.to_host(cpu) == (cpu, None)
    assert staging.to_device(cpu, torch.device("cpu")) is cpu
