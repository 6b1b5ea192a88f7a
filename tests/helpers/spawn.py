"""Run a function on N gloo ranks in real processes (torch.multiprocessing), on loopback."""

from __future__ import annotations

import datetime
import faulthandler
import gc
import os
import sys
import socket
import time
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, errors):
    try:
        faulthandler.enable(all_threads=True)  # a rank that crashes shows where
        os.environ["OMP_NUM_THREADS"] = "1"
        # A collective that a peer never issues fails after COLLECTIVE_TIMEOUT instead of hanging the test.
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=COLLECTIVE_TIMEOUT)
        fn(rank, world, *args)
        gc.collect()  # what a failed collective's traceback kept alive goes while Python still runs
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    # gloo's worker threads outlive destroy_process_group(); one that drops its last work while
    # the interpreter finalizes needs the GIL and aborts the process (SIGABRT) now and then.
    # The rank has passed: leave without finalizing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


PRELOAD = ["torch", "torch.distributed", "torchrec", "freescale.train.trainer"]
"""What the fork server imports once; each rank is forked from it with these in memory instead of
importing them again (seconds of CPU per rank). The server is a fresh process that does nothing
but import: no thread, no process group to inherit."""

_context = None


def _ranks_context():
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def run_ranks(world: int, fn, *args, timeout_s: float = 300) -> None:
    """Call ``fn(rank, world, *args)`` on ``world`` processes; re-raise the first failure.

    Ranks still running after ``timeout_s`` (all together) are killed and fail the call.
    """
    ctx = _ranks_context()
    errors = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, errors)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    running = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if not errors.empty():
        rank, tb = errors.get()
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    if running:
        raise AssertionError(f"rank(s) {running} still running after {timeout_s:g} s")
    for r, p in enumerate(procs):
        if p.exitcode != 0:
            raise AssertionError(f"rank {r} exited with {p.exitcode}")
