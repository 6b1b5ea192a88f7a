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
on a copy stream of its own (``cudaMemcpyAsync`` on CUDA: the copy engines move the bytes, no
kernel runs on the streaming multiprocessors); the host side waits for an event, the device
side for the copy stream, never the host. The ``host_staged`` transport and the replica
layer's cross-replica all-reduce stage device tensors through it.
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
    """Device <-> pinned host copies on a copy stream of their own (CUDA only)."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.module = torch.get_device_module(torch.device(device) if device is not None else "cuda")
        self.stream = self.module.Stream()

    def to_host(self, tensor: torch.Tensor, host: torch.Tensor):
        """Start copying ``tensor`` into pinned ``host`` (same shape and dtype) once the caller's
        stream has written it; the event that says the copy is complete."""
        ready = self.module.Event()
        self.stream.wait_stream(self.module.current_stream(tensor.device))
        with self.module.stream(self.stream):
            host.copy_(tensor, non_blocking=True)
            ready.record(self.stream)
        tensor.record_stream(self.stream)
        return ready

    def to_device(self, host: torch.Tensor, device: torch.device, out: torch.Tensor | None = None):
        """``host`` on ``device`` (into ``out`` when given), and the event that says the copy is
        complete (``host`` must not be written before); the caller's stream waits for the copy."""
        with self.module.stream(self.stream):
            if out is None:
                out = host.to(device, non_blocking=True)
            else:
                out.copy_(host, non_blocking=True)
            done = self.module.Event()
            done.record(self.stream)
        consumer = self.module.current_stream(device)
        consumer.wait_event(done)
        out.record_stream(consumer)
        return out, done


def staged_on_host(tensor: torch.Tensor, collective, engine: CopyEngine | None = None):
    """Run ``collective(host_tensor)`` (in place) on a pinned host copy of device ``tensor`` and
    copy the result back into it with the copy engine; on CPU, ``collective(tensor)``. Returns
    what ``collective`` returned."""
    if tensor.device.type == "cpu":
        return collective(tensor)
    engine = engine or CopyEngine(tensor.device)
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    engine.to_host(tensor, host).synchronize()
    result = collective(host)
    engine.to_device(host, tensor.device, out=tensor)
    return result

