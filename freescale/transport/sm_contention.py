"""What moving bytes costs the model's kernels on a GPU: a GEMM loop's slowdown beside copies.

Two ways to move bytes beside the model: an SM copy (an elementwise kernel, what a kernel-based
collective does) and a copy-engine copy (``cudaMemcpyAsync`` device -> pinned host, what
``host_staged`` does). Each runs on a side stream while a loop of GEMMs runs on the current
stream; the slowdown is the loop's device time against the loop alone, the variants taking
turns ``repeats`` times.

The copies must last as long as the loop, or its end runs alone and the slowdown is
understated: 24 SM copies of 512 MiB at ~3 TB/s are over in ~8 ms, a fraction of 20 GEMMs of
8192^2 in bf16 (~28 ms on an H100). So the loop is timed alone first, one copy of each kind is
timed alone, and each variant queues enough copies to last ``COVER`` times the loop alone (the
loop slows beside them, and so do the copies). The loop's span and the copies' span are timed
by events on their own streams and both are reported, with how long the copies ran before the
loop's first GEMM and after its last. A run whose copies did not cover the loop is measured
again with twice the copies, up to ``TRIES`` times; the result says whether every run was
covered (``covered``).
"""

from __future__ import annotations

import math
import statistics

import torch

COVER = 3.0  # copies queued to last this many times the GEMM loop alone
TRIES = 3  # runs with twice the copies when a run's copies ended before its loop
MOST_COPIES = 20_000  # launches queued for one run at most


def copies_to_cover(loop_ms: float, copy_ms: float, cover: float = COVER) -> int:
    """How many copies of ``copy_ms`` each to queue so that they last ``cover`` times a loop of
    ``loop_ms`` (at least one, at most ``MOST_COPIES``)."""
    return max(1, min(MOST_COPIES, math.ceil(cover * loop_ms / max(copy_ms, 1e-6))))


def covered(run: dict) -> bool:
    """Whether a run's copies began no later than its loop's first GEMM and ended no earlier
    than its last (``copies_before_ms`` and ``copies_after_ms`` both at least 0)."""
    return run["copies_before_ms"] >= 0.0 and run["copies_after_ms"] >= 0.0


def measure(timed, one_copy_ms: dict[str, float], loop_ms: float, repeats: int) -> dict[str, list[dict]]:
    """The runs of each variant, taking turns ``repeats`` times: ``timed(variant, copies)``
    times one run. Each copy variant's copies are sized from one copy's time and the loop's
    alone (``copies_to_cover``), and doubled, for that run and the later ones, after a run
    whose copies ended before its loop (``TRIES`` runs at most)."""
    copies = {name: copies_to_cover(loop_ms, ms) for name, ms in one_copy_ms.items()}
    runs = {name: [] for name in ("alone", *one_copy_ms)}
    for _ in range(repeats):
        runs["alone"].append(timed("alone", 0))
        for name in one_copy_ms:
            for _ in range(TRIES):
                run = timed(name, copies[name])
                if covered(run):
                    break
                copies[name] = min(MOST_COPIES, 2 * copies[name])
            runs[name].append(run)
    return runs


def summarize(runs: dict[str, list[dict]]) -> dict:
    """``covered`` (every copy run covered its loop) and ``<variant>_slowdown_pct`` (mean, min,
    max over the repeats, against the mean loop alone)."""
    alone = statistics.mean(r["gemm_ms"] for r in runs["alone"])
    variants = [name for name in runs if name != "alone"]
    result = {"covered": all(covered(r) for name in variants for r in runs[name])}
    for name in variants:
        pct = [100.0 * (r["gemm_ms"] / alone - 1.0) for r in runs[name]]
        result[f"{name}_slowdown_pct"] = {"mean": statistics.mean(pct), "min": min(pct), "max": max(pct)}
    return result


def gemm_slowdown(repeats: int = 3, n: int = 8192, gemms: int = 20, copy_mib: int = 512) -> dict | None:
    """The GEMM loop's slowdown beside each kind of copy on the current CUDA device (None
    without one): ``device``, ``runs`` (per variant, each repeat's ``gemm_ms``, ``copy_ms``,
    ``copies_before_ms``, ``copies_after_ms`` and ``copies``), and ``summarize``'s keys."""
    if not torch.cuda.is_available():
        return None
    device = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    src = torch.empty(copy_mib << 20, dtype=torch.uint8, device=device)
    to_device = torch.empty_like(src)
    to_host = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream(device=device)
    copy = {
        "sm_copy": lambda: torch.bitwise_or(src, 0, out=to_device),  # an elementwise kernel: runs on SMs
        "copy_engine": lambda: to_host.copy_(src, non_blocking=True),  # cudaMemcpyAsync D2H: no kernel
    }

    def loop():
        for _ in range(gemms):
            a @ a

    def nothing():
        pass

    # Warm up, then time the loop alone and one copy of each kind alone.
    _timed(loop, side, None, 0)
    loop_ms = statistics.median(_timed(loop, side, None, 0)["gemm_ms"] for _ in range(3))
    one_copy_ms = {}
    for name, fn in copy.items():
        _timed(nothing, side, fn, 1)
        one_copy_ms[name] = statistics.median(_timed(nothing, side, fn, 1)["copy_ms"] for _ in range(3))
    runs = measure(lambda name, count: _timed(loop, side, copy.get(name), count), one_copy_ms, loop_ms, repeats)
    return {"device": torch.cuda.get_device_name(device), "gemm": {"n": n, "dtype": "bfloat16", "per_loop": gemms},
            "copy_mib": copy_mib, "repeats": repeats, "loop_alone_ms": loop_ms, "one_copy_ms": one_copy_ms,
            "runs": runs, **summarize(runs)}


def _timed(loop, side, copy, count: int) -> dict:
    """One run: ``count`` copies queued on ``side``, then ``loop`` on the current stream once
    the copies have begun, each span timed by events on its own stream (from one origin)."""
    current = torch.cuda.current_stream()
    events = {k: torch.cuda.Event(enable_timing=True) for k in ("origin", "copy0", "copy1", "gemm0", "gemm1")}
    torch.cuda.synchronize()
    events["origin"].record(current)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        events["copy0"].record(side)
        for _ in range(count):
            copy()
        events["copy1"].record(side)
    current.wait_event(events["copy0"])  # the loop starts once the copies have
    events["gemm0"].record(current)
    loop()
    events["gemm1"].record(current)
    torch.cuda.synchronize()
    at = {k: events["origin"].elapsed_time(e) for k, e in events.items()}
    return {"gemm_ms": at["gemm1"] - at["gemm0"], "copy_ms": at["copy1"] - at["copy0"], "copies": count,
            "copies_before_ms": at["gemm0"] - at["copy0"], "copies_after_ms": at["copy1"] - at["gemm1"]}


def table(result: dict) -> str:
    """The result as a markdown table, both spans shown so a reader sees that they overlapped."""
    lines = [f"GEMM loop ({result['gemm']['per_loop']} x {result['gemm']['n']}^2 bf16) on {result['device']}, "
             f"beside {result['copy_mib']} MiB copies on a side stream, {result['repeats']} alternating repeats",
             "| beside the loop | copies per run | loop ms (mean, range) | copies' span ms | copies ran before / after "
             "the loop, ms | slowdown % (mean, range) |",
             "|---|---|---|---|---|---|"]
    for name, runs in result["runs"].items():
        loop = [r["gemm_ms"] for r in runs]
        row = f"| {name} | {runs[-1]['copies']} | {statistics.mean(loop):.2f} ({min(loop):.2f}-{max(loop):.2f}) | "
        if name == "alone":
            lines.append(row + "- | - | - |")
            continue
        pct = result[f"{name}_slowdown_pct"]
        span = statistics.mean(r["copy_ms"] for r in runs)
        before = min(r["copies_before_ms"] for r in runs)
        after = min(r["copies_after_ms"] for r in runs)
        lines.append(row + f"{span:.2f} | {before:.2f} / {after:.2f} (least) | "
                           f"{pct['mean']:+.1f} ({pct['min']:+.1f} to {pct['max']:+.1f}) |")
    sm, ce = result["sm_copy_slowdown_pct"]["mean"], result["copy_engine_slowdown_pct"]["mean"]
    lines.append(f"copy engine against SM copy: the loop loses {ce:.1f}% instead of {sm:.1f}%"
                 + ("" if result["covered"] else " (NOT every run's copies covered its loop: the slowdowns are understated)"))
    return "\n".join(lines)
