"""Streams, events and copy-engine copies on the run's device, through torch's device-generic API.

``Streams`` is what the pipelines over FreeScale's own tables use to put an exchange on a
side stream and hand its result back, with the ordering rules TorchRec's pipelines follow:

- a side stream waits for the stream that issues work on it (``on``: what the caller's
  stream wrote before, e.g. a table update, is in before the side stream reads it);
- the consumer's stream waits for the side stream before it reads a result (``take``);
- a tensor made on one stream and used on another is marked with ``record_stream`` so the
  caching allocator does not hand its memory out while the other stream may still read it.

The calls go through ``torch.get_device_module(device)`` (``torch.cuda`` on a GPU), so the
code is the same on every accelerator torch knows. On CPU there is one stream: every call is
a no-op and the overlap comes from the transport's threads, as it always has.

``CopyEngine`` moves a device tensor to pinned host memory and back with asynchronous copies
on copy streams of its own, one per direction and lane, made on the tensor's device
(``cudaMemcpyAsync`` on CUDA: the copy engines move the bytes, no kernel runs on the streaming
multiprocessors); the host side waits for an event, the device side for the copy stream,
never the host. The ``host_staged`` transport and the replica layer's cross-replica
all-reduce stage device tensors through it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def accelerated(device: torch.device | str) -> bool:
    """Whether ``device`` has streams of its own (anything but the CPU)."""
    return torch.device(device).type != "cpu"


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device`` without making the host wait.

    On an accelerator: copied from pinned memory (pinned first if it is not) with a
    non-blocking copy on the current stream. A copy from pageable memory makes the host wait
    until the copy is done, and with it every kernel queued before it (``memcpy_and_sync``);
    pinned blocks are reused only once their copy has completed (the caching host allocator
    records an event for it). On CPU: an alias of the tensor (the same memory, a tensor of its
    own), which is what the sync counter of the tests (``tests/helpers/syncs.py``) reads as "on
    the device"; nothing is copied.
    """
    if not accelerated(device):
        return torch.ops.aten.alias(tensor)
    if tensor.device.type != "cpu":
        return tensor.to(device, non_blocking=True)
    if not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


class Streams:
    """Side streams on ``device``; on CPU every call does nothing (``module`` lets a test record them)."""

    def __init__(self, device: torch.device | str = "cpu", module=None) -> None:
        self.device = torch.device(device)
        self.enabled = module is not None or accelerated(self.device)
        self.module = module or (torch.get_device_module(self.device) if self.enabled else None)

    def side(self):
        """A new side stream (None on CPU)."""
        return self.module.Stream(device=self.device) if self.enabled else None

    def current(self):
        return self.module.current_stream(self.device) if self.enabled else None

    @contextmanager
    def on(self, stream):
        """Issue the block's work on ``stream``, after what the current stream issued before it."""
        if stream is None or not self.enabled:
            yield
            return
        stream.wait_stream(self.current())
        with self.module.stream(stream):
            yield

    def take(self, tensor: torch.Tensor, producer) -> torch.Tensor:
        """``tensor``, made on ``producer``, for the current stream: the current stream waits for
        ``producer`` and the allocator keeps ``tensor``'s memory until the current stream is done."""
        if producer is not None and self.enabled:
            consumer = self.current()
            consumer.wait_stream(producer)
            if tensor.device.type != "cpu":
                tensor.record_stream(consumer)
        return tensor

    def wait_for(self, stream) -> None:
        """The current stream waits for what ``stream`` was given so far (e.g. a table update
        that ran there, before the current stream reads the table)."""
        if stream is not None and self.enabled:
            self.current().wait_stream(stream)

    def hand_over(self, tensor: torch.Tensor, stream) -> torch.Tensor:
        """``tensor``, made on the current stream, used by ``stream`` from now on."""
        if stream is not None and self.enabled and tensor.device.type != "cpu":
            tensor.record_stream(stream)
        return tensor

    def synchronize(self) -> None:
        if self.enabled:
            self.module.synchronize(self.device)


class CopyEngine:
    """Device <-> pinned host copies on copy streams of their own, on one device.

    A stream runs its work in order, so one copy stream for everything would make a copy to
    the device wait for every copy to the host queued before it (and the reverse), and a
    priority-lane copy wait for the normal lane's. There is a stream per direction, so both
    run at once (a GPU has a copy engine for each), and per lane (``high``: the transport's
    priority lane, ``freescale.transport.base.HIGH``): the high lane's streams take the
    highest priority torch gives (``Stream.priority_range()``), the normal lane's the default.
    CUDA applies priorities to kernels only, not to copies, so for the copies what counts is
    that the high lane's are not queued behind the normal lane's; the priority also draws
    those streams from torch's high-priority pool, apart from the normal-priority streams the
    rest of the program gets.

    The streams are made on ``device``, the tensors' device, whatever device is current:
    one engine per device (``staging.DeviceStaging`` keeps one per device it has seen).
    ``module`` is the device module (``torch.cuda``); a test gives one that records.
    """

    TO_HOST = "to_host"
    TO_DEVICE = "to_device"

    def __init__(self, device: torch.device | str, module=None) -> None:
        device = torch.device(device)
        self.module = module or torch.get_device_module(device)
        if device.index is None and accelerated(device):
            device = torch.device(device.type, self.module.current_device())
        self.device = device
        least, greatest = self.module.Stream.priority_range()
        self.streams = {(direction, high): self.module.Stream(device=device, priority=greatest if high else least)
                        for direction in (self.TO_HOST, self.TO_DEVICE) for high in (False, True)}
        """The copy streams by (direction, high)."""

    def to_host(self, tensor: torch.Tensor, host: torch.Tensor, high: bool = False, blocking: bool = False):
        """Start copying ``tensor`` into pinned ``host`` (same shape and dtype) once the caller's
        stream has written it; the event that says the copy is complete (``host`` must not be
        read before). ``blocking``: a thread that waits for the event sleeps instead of
        spinning (for a caller that waits at once; the transport's proxy only asks ``query()``)."""
        self._check(tensor.device)
        stream = self.streams[(self.TO_HOST, high)]
        stream.wait_stream(self.module.current_stream(self.device))
        with self.module.stream(stream):
            host.copy_(tensor, non_blocking=True)
        ready = self.module.Event(blocking=blocking)
        ready.record(stream)
        self._used_on(tensor, stream)  # the caller may drop it before the copy has read it
        return ready

    def to_device(self, host: torch.Tensor, device: torch.device, out: torch.Tensor | None = None,
                  high: bool = False):
        """``host`` on ``device`` (into ``out`` when given), and the event that says the copy is
        complete (``host`` must not be written before); the caller's stream waits for the copy.
        Into ``out``, the copy also waits for what the caller's stream issued before (which may
        still read ``out``)."""
        self._check(device if out is None else out.device)
        stream = self.streams[(self.TO_DEVICE, high)]
        consumer = self.module.current_stream(self.device)
        if out is not None:
            stream.wait_stream(consumer)
        with self.module.stream(stream):
            if out is None:
                out = host.to(self.device, non_blocking=True)
            else:
                out.copy_(host, non_blocking=True)
                self._used_on(out, stream)
        done = self.module.Event()
        done.record(stream)
        consumer.wait_event(done)
        self._used_on(out, consumer)  # made on the copy stream, freed by the caller's
        return out, done

    def _check(self, device: torch.device | str) -> None:
        device = torch.device(device)
        if device.index is None and accelerated(device):
            device = torch.device(device.type, self.module.current_device())
        if device != self.device:
            raise ValueError(f"a copy engine on {self.device} was given a tensor on {device} (one engine per device)")

    @staticmethod
    def _used_on(tensor: torch.Tensor, stream) -> None:
        """Tell the caching allocator that ``stream`` uses ``tensor`` (host memory has no such allocator)."""
        if tensor.device.type != "cpu":
            tensor.record_stream(stream)


def staged_on_host(tensor: torch.Tensor, collective, engine: CopyEngine | None = None):
    """Run ``collective(host_tensor)`` (in place) on a pinned host copy of device ``tensor`` and
    copy the result back into it with the copy engine; on CPU, ``collective(tensor)``. Returns
    what ``collective`` returned. ``engine`` must be ``tensor``'s device's (one is made if None)."""
    if tensor.device.type == "cpu":
        return collective(tensor)
    engine = engine or CopyEngine(tensor.device)
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    # This thread needs the bytes before it can go on: it sleeps until they are in.
    engine.to_host(tensor, host, blocking=True).synchronize()
    result = collective(host)
    # The pinned block goes back to torch's host allocator, which keeps it until the copy is done.
    engine.to_device(host, tensor.device, out=tensor)
    return result
