"""Benchmark of the transports: host_staged (SM-free proxy) against torch_dist (gloo / NCCL).

    .venv/bin/python scripts/bench_transport.py [--ranks 2 4] [--sizes-kib 4 64 1024 4096 16384 65536]
        [--local-paths mapped shm_ring] [--repeats 3]

For each rank count, in one job per rank count (real processes, gloo on loopback):
(1) all-to-all (equal splits) and all-gather of messages from 4 KiB to 64 MiB per rank, for
    torch_dist and each of host_staged's ways between ranks on one host (``--local-paths``):
    bandwidth = bytes each rank sends / time per collective in a stream of collectives back
    to back, and the latency of one collective alone (medians; each timed from the last
    rank's start to the last rank's end; the transports take turns), with the ratios to
    torch_dist;
(2) the slowdown of a dense compute loop (matmuls) on every rank while each transport runs
    20 all-to-alls of 4 MiB from a side thread, against the same loop alone, and the compute
    time lost per all-to-all (a faster transport slows the loop for less time);
(3) On a CUDA machine: a GEMM loop's slowdown (%) beside SM copies (an elementwise kernel)
    against copy-engine copies (cudaMemcpyAsync device->pinned host) on a side stream, sized
    to outlast the loop, with both spans reported, 3 alternating repeats
    (``freescale.transport.sm_contention``); skipped without CUDA (``--gpu-only``: this
    section alone, which needs torch and numpy only).

``--repeats N`` runs the CPU sections N times (one job per rank count each time): every cell
is then the median over the runs and, in brackets, their range (what docs/transport.md quotes).
Prints tables and writes ``runs/bench_transport.json`` (``worlds``: each rank count's runs).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from freescale.io import write_json_atomic  # noqa: E402
from freescale.transport import sm_contention  # noqa: E402



def _build(name: str):
    """``torch_dist`` or ``host_staged[<local path>]``."""
    from freescale.config import TransportConfig
    from freescale.transport.registry import build_transport

    if name == "torch_dist":
        return build_transport(TransportConfig(kind="torch_dist"))
    path = name[len("host_staged["):-1]
    return build_transport(TransportConfig(kind="host_staged", local_path=path))


def _time(fns: dict, reps: int, stream: int = 1) -> dict:
    """Median seconds per collective of each function, over ``reps`` samples.

    A sample is ``stream`` collectives back to back after a barrier (1: the latency of one
    collective; more: the time per collective of a stream, from which bandwidth is derived,
    as collective benchmarks do). It runs from the moment the last rank starts to the moment
    the last rank is done (ranks share the host's monotonic clock), so how unevenly the
    barrier releases the ranks is not counted. The transports take turns, so drift on the
    machine hits all alike.
    """
    for fn in fns.values():
        fn()  # warm
    spans = {k: [] for k in fns}
    for i in range(reps):
        for k in (list(fns) if i % 2 == 0 else list(fns)[::-1]):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(stream):
                fns[k]()
            spans[k].append((t0, time.perf_counter()))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, spans)
    return {k: statistics.median(max(r[k][i][1] for r in everyone) - max(r[k][i][0] for r in everyone)
                                 for i in range(reps)) / stream
            for k in fns}


def _matmul_rate(seconds: float, stop_when=None) -> float:
    a = torch.randn(256, 256)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a = torch.tanh(a @ a)
        n += 1
    return n / (time.perf_counter() - t0)


def _worker(rank: int, world: int, port: int, sizes_kib: list[int], names: list[str], out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    transports = {k: _build(k) for k in names}
    rows = []
    for kib in sizes_kib:
        nbytes = kib * 1024
        per_peer = max(1, nbytes // world)
        data = torch.randint(0, 255, (per_peer * world,), dtype=torch.uint8)
        splits = [per_peer] * world
        gather_in = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        reps, stream = (100, 10) if kib <= 1024 else (30, 5) if kib <= 4096 else (10, 3) if kib <= 16384 else (6, 2)
        if rank == 0:
            print(f"[bench_transport] {world} ranks, {kib} KiB: {reps} single collectives, {max(reps // 2, 3)} streams "
                  f"of {stream}", file=sys.stderr, flush=True)
        ops = {"all_to_all": {k: (lambda t=t: t.all_to_all_single(data, splits, splits).wait()) for k, t in transports.items()},
               "all_gather": {k: (lambda t=t: t.all_gather(gather_in).wait()) for k, t in transports.items()}}
        sent = {"all_to_all": nbytes, "all_gather": nbytes * (world - 1)}  # bytes each rank sends
        measured = {op: (_time(fns, reps), _time(fns, max(reps // 2, 3), stream)) for op, fns in ops.items()}
        for kind in transports:
            row = {"kib": kib, "transport": kind, "reps": reps, "stream": stream}
            for op, (latency, per_op) in measured.items():
                row.update({f"{op}_latency_s": latency[kind], f"{op}_stream_s": per_op[kind],
                            f"{op}_gbps": sent[op] / per_op[kind] / 1e9})
            rows.append(row)
    # Dense compute alone, then with each transport's all-to-alls running concurrently.
    dist.barrier()
    alone = _matmul_rate(2.0)
    overlap = {}
    payload = torch.randint(0, 255, (4 << 20,), dtype=torch.uint8)
    splits = [payload.numel() // world] * world
    for kind, t in transports.items():
        # The same number of all-to-alls on every rank (from a side thread), matmuls meanwhile.
        dist.barrier()
        mover = threading.Thread(target=lambda: [t.all_to_all_single(payload, splits, splits).wait() for _ in range(20)])
        n, a = 0, torch.randn(256, 256)
        t0 = time.perf_counter()
        mover.start()
        while mover.is_alive():
            a = torch.tanh(a @ a)
            n += 1
        elapsed = time.perf_counter() - t0
        rate = n / elapsed
        # Compute time lost per all-to-all: the matmuls not done meanwhile, at the rate alone.
        overlap[kind] = {"matmuls_per_s": rate, "slowdown": alone / rate, "all_to_alls": 20,
                         "all_to_all_s": elapsed / 20, "compute_lost_s": (alone * elapsed - n) / alone / 20}
    for t in transports.values():
        getattr(t, "close", lambda: None)()
    if rank == 0:
        out["rows"] = rows
        out["compute_alone_per_s"] = alone
        out["overlap"] = overlap
    dist.barrier()
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world: int, sizes_kib: list[int], names: list[str]) -> dict:
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    out = manager.dict()
    port = _port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, sizes_kib, names, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"a rank of the {world}-rank job failed with exit code {p.exitcode}")
    return dict(out)


def gpu_section(repeats: int = 3) -> dict | None:
    """(3): the GEMM loop beside each kind of copy (``freescale.transport.sm_contention``)."""
    result = sm_contention.gemm_slowdown(repeats)
    if result is None:
        print("\n(3) GPU: skipped (no CUDA device)")
        return None
    print("\n(3) GPU: " + sm_contention.table(result))
    return result


def spread(values: list[float], fmt: str, unit: str = "") -> str:
    """One table cell: the median of ``values`` (one per run) and its ``unit``, and over several
    runs their range."""
    text = fmt.format(statistics.median(values)) + unit
    return text if len(values) == 1 else f"{text} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[4, 64, 1024, 4096, 16384, 65536])
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "bench_transport.json"))
    parser.add_argument("--local-paths", nargs="+", default=["mapped", "shm_ring"], choices=["mapped", "shm_ring"],
                        help="host_staged's ways between ranks on one host to measure (transport.local_path)")
    parser.add_argument("--gpu-only", action="store_true", help="only the GPU section")
    parser.add_argument("--repeats", type=int, default=1, help="runs of the CPU sections; each cell is then the "
                        "median over the runs and their range (default 1)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats: expected at least 1, got {args.repeats}")

    staged = [f"host_staged[{p}]" for p in args.local_paths]
    result = {"worlds": {}}
    for world in ([] if args.gpu_only else _progress(args.ranks)):
        runs = [run_world(world, args.sizes_kib, ["torch_dist", *staged]) for _ in range(args.repeats)]
        result["worlds"][world] = {"runs": runs}
        by = [{(r["kib"], r["transport"]): r for r in data["rows"]} for data in runs]
        header = "| size | op | torch_dist | " + " | ".join(staged) + " | " + " | ".join(f"{s} / torch_dist" for s in staged) + " |"
        for title, cell, ratio in (
                ("bandwidth in GB/s (bytes a rank sends / time per collective, collectives back to back), "
                 "and its ratio to torch_dist", ("{:.2f}", lambda r, op: r[op + "_gbps"]),
                 lambda ref, r, op: ref[op + "_stream_s"] / r[op + "_stream_s"]),
                ("latency of one collective in ms, and torch_dist's latency over it",
                 ("{:.3f}", lambda r, op: 1e3 * r[op + "_latency_s"]),
                 lambda ref, r, op: ref[op + "_latency_s"] / r[op + "_latency_s"])):
            fmt, value = cell
            print(f"\n(1) {world} ranks on one host: {title}" + (f" (median of {args.repeats} runs, and their range)"
                                                                 if args.repeats > 1 else ""))
            print(header)
            print("|---" * (3 + 2 * len(staged)) + "|")
            for kib in args.sizes_kib:
                for op in ("all_to_all", "all_gather"):
                    size = f"{kib} KiB" if kib < 1024 else f"{kib // 1024} MiB"
                    cells = [spread([value(b[(kib, t)], op) for b in by], fmt) for t in ("torch_dist", *staged)]
                    ratios = [spread([ratio(b[(kib, "torch_dist")], b[(kib, s)], op) for b in by], "{:.2f}", "x")
                              for s in staged]
                    print(f"| {size} | {op} | " + " | ".join(cells + ratios) + " |")
        alone = spread([data["compute_alone_per_s"] for data in runs], "{:.1f}")
        print(f"\n(2) {world} ranks: matmul loop alone {alone}/s; beside 20 all-to-alls of 4 MiB from a side thread:")
        print("| transport | matmuls/s meanwhile | slowdown | ms per all-to-all | compute ms lost per all-to-all |")
        print("|---|---|---|---|---|")
        for kind in runs[0]["overlap"]:
            o = [data["overlap"][kind] for data in runs]
            print(f"| {kind} | {spread([x['matmuls_per_s'] for x in o], '{:.1f}')} | "
                  f"{spread([x['slowdown'] for x in o], '{:.3f}', 'x')} | "
                  f"{spread([1e3 * x['all_to_all_s'] for x in o], '{:.1f}')} | "
                  f"{spread([1e3 * x['compute_lost_s'] for x in o], '{:.2f}')} |")
    result["gpu"] = gpu_section()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_json_atomic(args.out, result)
    print(f"\nwrote {args.out}")
    if result["gpu"] is not None and not result["gpu"]["covered"]:
        raise SystemExit("bench_transport: a run's copies ended before its GEMM loop even with more copies: "
                         "the GPU slowdowns are understated")


def _progress(ranks: list[int]):
    from freescale.progress import bar  # tqdm: only the CPU sections need it

    return bar(ranks, desc="bench_transport", unit="rank count")


if __name__ == "__main__":
    main()
