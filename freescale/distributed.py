"""Process-group set-up and the job's topology.

A job is either launched by torchrun (RANK/WORLD_SIZE/MASTER_ADDR set) or run standalone, in
which case a one-rank gloo group over an in-process store is created so the rest of the code
(DMP, collectives) is the same in both cases.

Every collective of the trainer runs on the replica's own process group (``Topology.group``),
never on the world implicitly: with several replicas in one world (the replica layer, or a
test), the world is not one replica. Ranks in a ``Topology`` are ranks within the replica.
"""

from __future__ import annotations

import datetime
import gc
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from freescale import env


@dataclass(frozen=True)
class Topology:
    """Where this process sits: its rank among the ranks of its replica, and the replica's group."""

    rank: int
    """Rank within the replica."""
    world_size: int
    """Ranks in the replica."""
    local_rank: int
    local_world_size: int
    replica_id: int = 0
    num_replicas: int = 1
    group: dist.ProcessGroup | None = None
    """The replica's process group (None: the default group, which is then the replica)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def pg(self) -> dist.ProcessGroup:
        return self.group or dist.group.WORLD


def resolve_device(kind: str, local_rank: int) -> torch.device:
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("run.device is cuda but no CUDA device is available")
        # More ranks than GPUs on a host share them round-robin (gloo then; NCCL refuses two
        # ranks on one device).
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def group_backend(device: torch.device, backend: str = "auto") -> str:
    """The backend string a job's process group is made with: ``train.backend`` (``auto``: NCCL
    on CUDA, gloo on CPU), with gloo beside NCCL for CPU tensors (``cpu:gloo,cuda:nccl``).

    Some collectives of a GPU run carry host tensors by design (the held-out metrics' counts,
    TorchRec's metric state, the replica layer's group check, the pipelines' routes); a group
    made with NCCL alone refuses them ("No backend type associated with device type cpu")."""
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def init_distributed(device: torch.device, backend: str = "auto", timeout_s: float = 300.0) -> Topology:
    """Initialize the default process group (idempotent) and return the topology."""
    backend = group_backend(device, backend)
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
    """Split the cores this process may run on (``env.cores()``) between the host's ranks
    unless a count is requested."""
    threads = requested or env.cores_per_rank(local_world_size)
    torch.set_num_threads(threads)
    return threads


def broadcast_object(obj, group: dist.ProcessGroup, src: int = 0):
    """Broadcast a picklable object from rank ``src`` of ``group`` to the group's ranks."""
    box = [obj]
    dist.broadcast_object_list(box, group=group, group_src=src)
    return box[0]


def agreed(read, group: dist.ProcessGroup):
    """Rank 0's ``read()`` on every rank of ``group`` (only rank 0 reads): for what the ranks of
    one replica group must decide alike from files other processes write, where two ranks'
    looks a moment apart can see different things."""
    return broadcast_object(read() if dist.get_rank(group) == 0 else None, group)


def all_gather_object(obj, group: dist.ProcessGroup) -> list:
    """Every rank's ``obj``, in the group's rank order."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def new_group_like(group: dist.ProcessGroup, backend: str = "gloo") -> dist.ProcessGroup:
    """A new group over the same ranks as ``group`` (only those ranks take part in making it):
    gloo, or ``backend`` ("same": ``group``'s own, NCCL beside gloo on a GPU run)."""
    ranks = dist.get_process_group_ranks(group)
    if backend == "same":
        backend = dist.get_backend(group)
    return dist.new_group(ranks=ranks, backend=backend, use_local_synchronization=True)


def shutdown() -> None:
    """Destroy the process groups, after collecting what reference cycles still hold of them.

    gloo's worker threads live as long as their group; one that drops its last work while the
    interpreter finalizes needs the GIL and aborts the process. Collecting first lets the
    groups and their works go while Python still runs.
    """
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def estimate_clock_offset(group: dist.ProcessGroup, rounds: int = 5) -> float:
    """Seconds to add to this rank's ``time.time()`` to read the clock of ``group``'s rank 0.

    Ranks on that rank's host share its clock (offset 0). Others take the median, over a few
    rounds, of the difference between rank 0's and their own clock right after a barrier;
    the estimate is good to about one barrier's latency.
    """
    me = dist.get_rank(group)
    hosts = all_gather_object(os.uname().nodename, group)
    diffs = []
    for _ in range(rounds):
        dist.barrier(group=group)
        stamps = all_gather_object(time.time(), group)
        diffs.append(stamps[0] - stamps[me])
    if hosts[me] == hosts[0]:
        return 0.0
    return float(sorted(diffs)[len(diffs) // 2])
