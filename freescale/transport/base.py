"""The transport interface and its registry.

A transport moves bytes for the collectives that carry no reduction: ``all_to_all_single``
with uneven splits (zero-length splits included) and ``all_gather`` (equal or uneven sizes).
Both are asynchronous: they return a ``Handle`` whose ``wait()`` returns the result and
raises ``TransportError`` if the collective failed (a peer died, the timeout passed).

Splits and sizes count rows along dimension 0; every rank must pass the same ``sizes`` to
``all_gather`` and matching splits to ``all_to_all_single`` (rank i's input split j is rank
j's output split i).
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.distributed as dist


class TransportError(RuntimeError):
    """A collective that did not complete; the message names the operation and the cause."""


class Handle(Protocol):
    def wait(self) -> torch.Tensor: ...


class Transport(Protocol):
    rank: int
    world_size: int

    def all_to_all_single(self, tensor: torch.Tensor, input_splits: list[int], output_splits: list[int]) -> Handle: ...

    def all_gather(self, tensor: torch.Tensor, sizes: list[int] | None = None) -> Handle: ...


TRANSPORTS: dict[str, Callable[..., Transport]] = {}


def register(name: str):
    def wrap(factory):
        TRANSPORTS[name] = factory
        return factory

    return wrap


def build_transport(cfg, group: dist.ProcessGroup | None = None) -> Transport:
    """The transport ``cfg.kind`` (a TransportConfig) over ``group`` (default: the world)."""
    import freescale.transport.host_staged  # noqa: F401  (registers itself)
    import freescale.transport.torch_dist  # noqa: F401  (registers itself)

    if cfg.kind not in TRANSPORTS:
        raise ValueError(f"unknown transport {cfg.kind!r}; expected one of {sorted(TRANSPORTS)}")
    return TRANSPORTS[cfg.kind](group, cfg)
