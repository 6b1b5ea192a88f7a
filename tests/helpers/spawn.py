"""Run a function on N gloo ranks in real processes (torch.multiprocessing), on loopback."""

from __future__ import annotations

import faulthandler
import os
import socket
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, errors):
    try:
        faulthandler.enable(all_threads=True)  # a rank that crashes shows where
        os.environ["OMP_NUM_THREADS"] = "1"
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        fn(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise


def run_ranks(world: int, fn, *args) -> None:
    """Call ``fn(rank, world, *args)`` on ``world`` processes; re-raise the first failure."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, errors)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    if not errors.empty():
        rank, tb = errors.get()
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    for p in procs:
        if p.exitcode != 0:
            p.kill()
            raise AssertionError(f"a rank exited with {p.exitcode}")
