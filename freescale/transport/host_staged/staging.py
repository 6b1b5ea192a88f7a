"""CUDA staging: device tensors through pinned host buffers, moved by the copy engine.

A device tensor is copied into a pinned host buffer with ``cudaMemcpyAsync`` on a dedicated
copy stream (``copy_(non_blocking=True)``) after the caller's stream; the proxy waits for
that copy's event before reading the buffer. The result comes back the same way, and the
caller's stream waits on an event, never on the host. No kernel of ours runs: the streaming
multiprocessors stay with the model. On CPU nothing is staged.
"""

from __future__ import annotations

import torch

from freescale.transport.host_staged.memory import BufferPool


class CudaStaging:
    def __init__(self, pool: BufferPool) -> None:
        self.pool = pool
        self.stream = torch.cuda.Stream()

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """A pinned copy of ``tensor`` (under way), and the event that says it is complete."""
        host = self.pool.take(tuple(tensor.shape), tensor.dtype, pinned=True)
        ready = torch.cuda.Event()
        self.stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(self.stream):
            host.copy_(tensor, non_blocking=True)
            ready.record(self.stream)
        return host, ready

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``host`` on ``device``; the caller's stream waits for the copy."""
        with torch.cuda.stream(self.stream):
            out = host.to(device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        consumer = torch.cuda.current_stream(device)
        consumer.wait_event(done)
        out.record_stream(consumer)
        return out
