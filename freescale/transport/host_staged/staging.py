"""Device staging: device tensors through pinned host buffers, moved by the copy engine.

A device tensor is copied into a pooled pinned host buffer with ``cudaMemcpyAsync`` on a
dedicated copy stream (``freescale.device.CopyEngine``) after the caller's stream; the proxy
waits for that copy's event before reading the buffer. The result comes back the same way,
and the caller's stream waits on an event, never on the host. No kernel of ours runs: the
streaming multiprocessors stay with the model. A CPU tensor is not staged (``needs_staging``).
"""

from __future__ import annotations

import torch

from freescale.device import CopyEngine
from freescale.transport.host_staged.memory import BufferPool


def needs_staging(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` must go through pinned host memory (it lives on a device)."""
    return tensor.device.type != "cpu"


class DeviceStaging:
    def __init__(self, pool: BufferPool) -> None:
        self.pool = pool
        self.engine = CopyEngine()
        # Pool buffers whose copy to the device may still be under way: holding them keeps the
        # pool from handing them out again (it reuses a buffer nobody references).
        self._copying: list[tuple[object, torch.Tensor]] = []

    def to_host(self, tensor: torch.Tensor):
        """A pinned copy of ``tensor`` (under way), and the event that says it is complete."""
        host = self.pool.take(tuple(tensor.shape), tensor.dtype, pinned=True)
        return host, self.engine.to_host(tensor, host)

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``host`` on ``device``; the caller's stream waits for the copy."""
        self._copying = [(done, buf) for done, buf in self._copying if not done.query()]
        out, done = self.engine.to_device(host, device)
        self._copying.append((done, host))
        return out
