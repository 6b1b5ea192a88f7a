"""Process-group set-up and the job's topology.

A job is either launched by torchrun (RANK/WORLD_SIZE/MASTER_ADDR set) or run standalone, in
which case a one-rank gloo group over an in-process store is created so the rest of the code
(DMP, collectives) is the same in both cases.
"""

from __future__ import annotations

import datetime
import time
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from freescale import env


@dataclass(frozen=True)
class Topology:
    """Where this process sits. Replicas arrive with the fault-tolerance layer; today one."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    replica_id: int = 0
    num_replicas: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(kind: str, local_rank: int) -> torch.device:
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("run.device is cuda but no CUDA device is available")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device: torch.device, backend: str = "auto", timeout_s: float = 300.0) -> Topology:
    """Initialize the default process group (idempotent) and return the topology."""
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if env.launched_by_torchrun():
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    return Topology(
        rank=rank,
        world_size=world_size,
        local_rank=env.get_int(env.LOCAL_RANK, 0),
        local_world_size=env.get_int(env.LOCAL_WORLD_SIZE, world_size if not env.launched_by_torchrun() else 1),
    )


def set_threads(requested: int, local_world_size: int) -> int:
    """Split the host's cores between its ranks unless a count is requested."""
    threads = requested or max(1, (os.cpu_count() or 1) // max(1, local_world_size))
    torch.set_num_threads(threads)
    return threads


def broadcast_object(obj, src: int = 0):
    """Broadcast a picklable object from ``src`` to every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def estimate_clock_offset(rounds: int = 5) -> float:
    """Seconds to add to this rank's ``time.time()`` to read rank 0's clock.

    Ranks on rank 0's host share its clock (offset 0). Others take the median, over a few
    rounds, of the difference between rank 0's and their own clock right after a barrier;
    the estimate is good to about one barrier's latency.
    """
    world = dist.get_world_size()
    hosts = [None] * world
    dist.all_gather_object(hosts, os.uname().nodename)
    diffs = []
    for _ in range(rounds):
        dist.barrier()
        stamps = [None] * world
        dist.all_gather_object(stamps, time.time())
        diffs.append(stamps[0] - stamps[dist.get_rank()])
    if hosts[dist.get_rank()] == hosts[0]:
        return 0.0
    return float(sorted(diffs)[len(diffs) // 2])
