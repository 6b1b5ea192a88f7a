"""Transports by the name ``transport.kind`` gives them."""

from __future__ import annotations

from typing import Callable

import torch.distributed as dist

from freescale.transport.base import Transport
from freescale.transport.host_staged import HostStagedTransport
from freescale.transport.torch_dist import TorchDistTransport

TRANSPORTS: dict[str, Callable[..., Transport]] = {
    "torch_dist": TorchDistTransport,
    "host_staged": HostStagedTransport,
}


def build_transport(cfg, group: dist.ProcessGroup | None = None, lanes: int = 1) -> Transport:
    """The transport ``cfg.kind`` (a TransportConfig) over ``group`` (default: the world), with
    ``lanes`` lanes (2: a priority lane besides the normal one)."""
    if cfg.kind not in TRANSPORTS:
        raise ValueError(f"unknown transport {cfg.kind!r}; expected one of {sorted(TRANSPORTS)}")
    return TRANSPORTS[cfg.kind](group, cfg, lanes=lanes)
