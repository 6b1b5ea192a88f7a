"""Transports by the name ``transport.kind`` gives them."""

from __future__ import annotations

from typing import Callable

import torch.distributed as dist

from freescale import env
from freescale.transport.base import Transport
from freescale.transport.host_staged import HostStagedTransport
from freescale.transport.torch_dist import TorchDistTransport

TRANSPORTS: dict[str, Callable[..., Transport]] = {
    "torch_dist": TorchDistTransport,
    "host_staged": HostStagedTransport,
}


GROUP_BACKENDS = {"torch_dist": "same", "host_staged": "gloo"}
"""The backend of the group a transport runs over (``distributed.new_group_like``): torch_dist
runs its collectives on the run's own backend (NCCL on CUDA), host_staged its control wire and
its transfers between hosts over gloo (host memory)."""


def group_for(kind: str, group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A group of its own over ``group``'s ranks for a transport of ``kind``."""
    from freescale.distributed import new_group_like

    if kind not in GROUP_BACKENDS:
        raise ValueError(f"unknown transport {kind!r}; expected one of {sorted(GROUP_BACKENDS)}")
    return new_group_like(group, backend=GROUP_BACKENDS[kind])


def build_transport(cfg, group: dist.ProcessGroup | None = None, lanes: int = 1) -> Transport:
    """The transport ``cfg.kind`` (a TransportConfig) over ``group`` (default: the world), with
    ``lanes`` lanes (2: a priority lane besides the normal one)."""
    if cfg.kind not in TRANSPORTS:
        raise ValueError(f"unknown transport {cfg.kind!r}; expected one of {sorted(TRANSPORTS)}")
    return TRANSPORTS[cfg.kind](group, cfg, lanes=lanes)


def lanes_for(setting: int | str, group: dist.ProcessGroup, kind: str) -> tuple[int, str]:
    """The lanes a transport of ``kind`` over ``group`` is built with for the config's
    ``transport.lanes``, and why (for the log). ``auto``: two, except on a transport whose lanes
    run threads of their own (``torch_dist``: a gloo group per lane) where some rank of
    ``group`` has a core or less to itself (its affinity's cores shared among its host's ranks):
    there the second lane's threads run on the core that computes and cost more than the
    priority buys (docs/prioritized.md). Every rank of ``group`` takes part and gets the same
    answer (a lane is a process group of its own: ranks must agree to make one)."""
    if setting != "auto":
        return int(setting), "transport.lanes"
    if not TRANSPORTS[kind].lane_has_threads:
        return 2, f"auto: {kind}'s lanes share its threads"
    from freescale.distributed import all_gather_object

    fewest = min(all_gather_object(env.cores_per_rank(env.get_int(env.LOCAL_WORLD_SIZE, 1)), group))
    return (2 if fewest >= 2 else 1), f"auto: {fewest} core{'s' if fewest > 1 else ''} per rank on the fewest"
