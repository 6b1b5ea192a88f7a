"""The machine's matrix-multiply peak, measured, against which MFU is reported.

A datasheet peak says little about a shared CPU or about the small widths a recommendation
model multiplies at; so the peak is measured: fp32 products ``(tokens x k) @ (k x n)`` at the
model's own widths (``freescale.model.flops.matmul_widths``), with the thread count the run
computes with, each timed after a warm-up as the best of a few repeats (about 10 ms each),
and the fastest shape's FLOP/s is the peak. It takes a fraction of a second and is cached in
a JSON file under a key of everything it depends on (host name, CPU model, device name, torch
version, threads, TF32 on CUDA, the shapes); a change of any of them measures again.

On CUDA the products are timed with events on the current stream after a synchronize, so
the time is the device's, not the host's launch time.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass

import torch

from freescale.io import write_json_atomic

PEAK_FILE = "matmul_peak.json"
"""The peak a run's MFU is against, stored in its folder (the bubble report reads it)."""
TOKENS = 4096
"""Rows of the calibration products (history tokens of a typical batch)."""
REPEATS = 5
"""Timed repeats per shape; the best counts (the least disturbed by other work)."""
TARGET_S = 0.01
"""Wall time of one timed repeat (enough products to make the timer's resolution negligible)."""


@dataclass
class MatmulPeak:
    """A measured peak: ``flop_per_s`` is the fastest shape's (``per_shape`` holds each)."""

    flop_per_s: float
    key: dict
    per_shape: list[dict]
    seconds: float
    """How long the measurement took (0 when read from the cache)."""
    cached: bool = False


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def peak_key(device: torch.device, widths: list[tuple[int, int]], tokens: int = TOKENS) -> dict:
    """Everything the measurement depends on."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    return {
        "host": platform.node(),
        "cpu": cpu_model(),
        "device": torch.cuda.get_device_name(device) if cuda else device.type,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "tf32": bool(torch.backends.cuda.matmul.allow_tf32) if cuda else False,
        "dtype": "float32",
        "shapes": [[tokens, k, n] for k, n in sorted(widths)],
    }


def _products_time(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, count: int) -> float:
    """Seconds ``count`` products take (device time on CUDA)."""
    if a.device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(a.device)
        start.record()
        for _ in range(count):
            torch.mm(a, b, out=out)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0
    t0 = time.perf_counter()
    for _ in range(count):
        torch.mm(a, b, out=out)
    return time.perf_counter() - t0


def time_matmul(m: int, k: int, n: int, device: torch.device, repeats: int = REPEATS) -> float:
    """Best FLOP/s of ``(m x k) @ (k x n)`` in fp32 on ``device`` over ``repeats`` timed runs."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g).to(device)
    b = torch.randn(k, n, generator=g).to(device)
    out = torch.empty(m, n, device=device)
    once = max(_products_time(a, b, out, 1), _products_time(a, b, out, 1), 1e-7)  # the first includes set-up
    count = max(1, math.ceil(TARGET_S / once))
    _products_time(a, b, out, count)  # warm-up at the timed size
    best = min(_products_time(a, b, out, count) for _ in range(repeats))
    return 2.0 * m * n * k * count / max(best, 1e-9)


def measure(device: torch.device, widths: list[tuple[int, int]], tokens: int = TOKENS) -> MatmulPeak:
    started = time.perf_counter()
    key = peak_key(device, widths, tokens)
    per_shape = [{"m": m, "k": k, "n": n, "flop_per_s": time_matmul(m, k, n, torch.device(device))}
                 for m, k, n in key["shapes"]]
    return MatmulPeak(max(s["flop_per_s"] for s in per_shape), key, per_shape, time.perf_counter() - started)


def matmul_peak(device: torch.device, widths: list[tuple[int, int]], cache_path: str, tokens: int = TOKENS) -> MatmulPeak:
    """The peak for this machine and these widths: from ``cache_path`` when it holds one under
    the same key, else measured now and added to it (written atomically; "" = no cache)."""
    key = peak_key(device, widths, tokens)
    name = json.dumps(key, sort_keys=True)
    entries = _read_cache(cache_path)
    if name in entries:
        return MatmulPeak(**{**entries[name], "seconds": 0.0, "cached": True})
    peak = measure(device, widths, tokens)
    if cache_path:
        os.makedirs(os.path.dirname(os.path.abspath(cache_path)), exist_ok=True)
        entries = _read_cache(cache_path)  # another run may have added its own meanwhile
        entries[name] = {k: v for k, v in asdict(peak).items() if k != "cached"}
        write_json_atomic(cache_path, entries)
    return peak


def _read_cache(path: str) -> dict:
    """The cache's entries by key; empty when there is none or it is unreadable (measured again)."""
    if not path or not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            entries = json.load(f)
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}
