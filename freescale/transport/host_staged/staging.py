"""Device staging: device tensors through pinned host buffers, moved by the copy engine.

A device tensor is copied into a pooled pinned host buffer with ``cudaMemcpyAsync`` on a copy
stream of its device's ``freescale.device.CopyEngine`` (one per device, made at its first
tensor; a stream per direction and lane, so a high-lane copy does not queue behind a normal
one), after the caller's stream. The proxy starts the collective once that copy's event says
it is complete (it asks, ``query()``, and never waits for it). The result comes back the same
way, and the caller's stream waits on an event, never the host. No kernel of ours runs: the
streaming multiprocessors stay with the model. A CPU tensor is not staged: it passes through.
"""

from __future__ import annotations

import threading

import torch

from freescale.device import CopyEngine
from freescale.transport.host_staged.memory import BufferPool


def needs_staging(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` must go through pinned host memory (it lives on a device)."""
    return tensor.device.type != "cpu"


class DeviceStaging:
    """Device tensors in and out of the pool's pinned buffers; CPU tensors as they are."""

    def __init__(self, pool: BufferPool, engine=CopyEngine) -> None:
        self.pool = pool
        self._new_engine = engine  # device -> its CopyEngine (a test gives engines over a recording module)
        self._engines: dict[torch.device, CopyEngine] = {}
        # Pool buffers whose copy to the device may still be under way: holding them keeps the
        # pool from handing them out again (it reuses a buffer nobody references).
        self._copying: list[tuple[object, torch.Tensor]] = []
        self._lock = threading.Lock()  # collectives are issued and waited for from any thread

    def engine(self, device: torch.device) -> CopyEngine:
        """``device``'s copy engine (made at its first tensor)."""
        with self._lock:
            if device not in self._engines:
                self._engines[device] = self._new_engine(device)
            return self._engines[device]

    def to_host(self, tensor: torch.Tensor, high: bool = False):
        """The bytes to send, and the event that says they are in (None: they are now): a
        device tensor's pinned copy (under way), a CPU tensor itself."""
        if not needs_staging(tensor):
            return tensor, None
        host = self.pool.take(tuple(tensor.shape), tensor.dtype, pinned=True)
        return host, self.engine(tensor.device).to_host(tensor, host, high=high)

    def to_device(self, host: torch.Tensor, device: torch.device, high: bool = False) -> torch.Tensor:
        """``host`` on ``device`` (itself on CPU); the caller's stream waits for the copy."""
        if device.type == "cpu":
            return host
        out, done = self.engine(device).to_device(host, device, high=high)
        with self._lock:
            self._copying = [(event, buf) for event, buf in self._copying if not event.query()]
            self._copying.append((done, host))
        return out
