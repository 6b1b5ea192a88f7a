"""Measures of the data path: how fast one rank's reader turns a prepared dataset into batches,
and how much memory a process that reads it (or a command) needs at its peak.

``scripts/bench_data.py`` sets these beside what training consumes.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time

import numpy as np


def reader_throughput(folder: str, *, batch_size: int, ranks: int, seconds: float, start_batch: int = 0,
                      threads: int = 1) -> dict:
    """Rank 0's reader (``ParquetSource`` through the loader, then ``Batch.from_samples``) on
    ``threads`` intra-op threads, run for about ``seconds``: its samples/s, and the batches and
    row groups it went through."""
    import torch

    from freescale.data.batch import Batch
    from freescale.data.loader import BatchLoader
    from freescale.data.parquet_source import ParquetSource

    torch.set_num_threads(threads)
    source = ParquetSource(folder, "train")
    loader = BatchLoader(source, batch_size=batch_size, rank=0, world_size=ranks, user_hash_size=1 << 20,
                         next_batch=start_batch)
    batches = loader.iter_samples()
    samples, steps = 0, 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        k, local = next(batches)
        Batch.from_samples(local, k, 1 << 20)
        samples += len(local)
        steps += 1
    elapsed = time.perf_counter() - started
    return {"samples_per_s": samples / elapsed, "batches": steps, "seconds": elapsed}


def reader_pass(folder: str, *, batch_size: int, ranks: int, stride: int = 1) -> dict:
    """Rank 0 reads every ``stride``-th global batch of one epoch of the train split: the batches,
    the samples and this process's peak RSS (MiB) before and after (a bounded reader ends where
    it began, whatever the dataset's size)."""
    from freescale.data.batch import Batch
    from freescale.data.loader import BatchLoader
    from freescale.data.parquet_source import ParquetSource

    source = ParquetSource(folder, "train")
    loader = BatchLoader(source, batch_size=batch_size, rank=0, world_size=ranks, user_hash_size=1 << 20)
    epoch = source.num_samples // loader.global_batch_size
    Batch.from_samples(loader.local_samples(0), 0, 1 << 20)
    before = peak_rss_mib()
    samples = 0
    started = time.perf_counter()
    for k in range(0, epoch, stride):
        samples += len(Batch.from_samples(loader.local_samples(k), k, 1 << 20))
    return {"batches": len(range(0, epoch, stride)), "samples": samples, "seconds": time.perf_counter() - started,
            "rss_before_mib": before, "rss_peak_mib": peak_rss_mib()}


def peak_rss_mib() -> float:
    """This process's peak resident set size so far, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run_measured(cmd: list[str], *, cwd: str | None = None, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``cmd`` in a child of its own; (the completed process, the peak RSS in MiB of the
    largest process it ran: the command or any descendant it waited for, e.g. a torchrun rank)."""
    probe = ("import resource, subprocess, sys\n"
             "p = subprocess.run(sys.argv[1:])\n"
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
             "sys.exit(p.returncode)\n")
    proc = subprocess.run([sys.executable, "-c", probe, *cmd], cwd=cwd, env=env, capture_output=True, text=True)
    lines = proc.stderr.strip().splitlines()
    try:
        rss = int(lines[-1]) / 1024.0
        proc.stderr = "\n".join(lines[:-1])
    except (IndexError, ValueError):
        rss = float("nan")
    return proc, rss


def disk_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def spread(values: list[float]) -> dict:
    """Mean, min and max of repeated measures."""
    v = np.asarray(values, dtype=np.float64)
    return {"mean": float(v.mean()), "min": float(v.min()), "max": float(v.max()), "runs": [float(x) for x in v]}
