"""Every environment variable FreeScale reads, named once.

Only process plumbing that torchrun or torchft dictate is read from the environment; every other knob
lives in the config tree.
"""

from __future__ import annotations

import os

RANK = "RANK"
"""Global rank of this process (set by torchrun)."""
WORLD_SIZE = "WORLD_SIZE"
"""Number of processes in the job (set by torchrun)."""
LOCAL_RANK = "LOCAL_RANK"
"""Rank of this process on its host; selects the GPU (set by torchrun)."""
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
"""Processes on this host; divides the CPU cores between ranks (set by torchrun)."""
MASTER_ADDR = "MASTER_ADDR"
"""Rendezvous host of the default process group (set by torchrun)."""
TORCHFT_LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"
"""Address of the torchft lighthouse a replica group reports to (``http://HOST:PORT``; torchft's
own name for it); set by a launcher (``freescale.torchx``), it takes precedence over
``ft.lighthouse``."""
TORCH_DISABLE_SHARE_RDZV_TCP_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""``1``: torchrun gives each start of its ranks a store of their own. Set by a launcher whose
torchrun restarts a group in place (``freescale.torchx``): torchrun's shared store keeps the
previous start's keys, and the restarted ranks' gloo group then dials the dead ranks' addresses
(seen with torch 2.13: every restart failed in ``connectFullMesh``)."""


def get_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def cores() -> int:
    """The CPU cores this process may run on: its affinity mask (what ``taskset``, a cgroup
    cpuset or a container's CPU pinning leaves it), not the machine's count, which a process
    pinned to fewer cores would oversubscribe."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity masks on this platform
        return os.cpu_count() or 1


def cores_per_rank(local_world_size: int) -> int:
    """This process's share of its ``cores()`` when ``local_world_size`` ranks share them (at
    least one)."""
    return max(1, cores() // max(1, local_world_size))


def launched_by_torchrun() -> bool:
    return RANK in os.environ and WORLD_SIZE in os.environ and MASTER_ADDR in os.environ
