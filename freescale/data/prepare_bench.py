"""Measuring ``freescale prepare`` on synthetic event logs: throughput and peak memory.

Each measurement runs ``python -m freescale prepare`` as its own process on a log written by
``event_log.write_event_log`` (once, then reused) and takes the process's wall time and peak
resident memory from ``os.wait4`` (the kernel's ``ru_maxrss`` of that child alone, DuckDB's
threads included), and its CPU time (user + system: less sensitive than the wall time to other
work on the machine). ``scripts/bench_prepare.py`` runs the grid and writes the table.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

from freescale.data.event_log import write_event_log

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def ensure_log(folder: str, events: int, *, users: int, items: int, seed: int = 0, say=print) -> str:
    """The event log of ``events`` events in ``folder`` (written once; a ``log.json`` marks it complete)."""
    marker = os.path.join(folder, "log.json")
    params = {"events": events, "users": users, "items": items, "seed": seed}
    if os.path.isfile(marker) and json.load(open(marker)) == params:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    say(f"writing a {events:,}-event log into {folder}")
    started = time.monotonic()
    write_event_log(folder, events, users=users, items=items, seed=seed)
    with open(marker, "w") as f:
        json.dump(params, f)
    say(f"  {time.monotonic() - started:.0f} s, {_size(folder) / 2**30:.2f} GiB")
    return folder


def _size(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(folder) for f in files)


def prepare_once(log: str, out: str, *, events: int, memory_limit: str, threads: int, max_uih_len: int,
                 num_candidates: int) -> dict:
    """One fresh ``freescale prepare`` of the log (ranking), measured."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "freescale", "prepare", "--input", os.path.join(log, "*.parquet"), "--format", "events",
           "--columns", "user=user,item=item,time=timestamp,rating=rating", "--out", out, "--task", "ranking",
           "--max-uih-len", str(max_uih_len), "--num-candidates", str(num_candidates),
           "--memory-limit", memory_limit, "--threads", str(threads)]
    result = _measured_child(cmd)
    row = {"events": events, "memory_limit": memory_limit, "threads": threads, "max_uih_len": max_uih_len,
           "num_candidates": num_candidates, "seconds": round(result["seconds"], 1),
           "cpu_seconds": round(result["cpu_seconds"], 1),
           "events_per_s": round(events / result["seconds"]), "peak_rss_gib": round(result["peak_rss_bytes"] / 2**30, 3),
           "returncode": result["returncode"], "command": " ".join(cmd[1:])}
    if result["returncode"] == 0:
        manifest = json.load(open(os.path.join(out, "manifest.json")))
        row.update(samples=manifest["splits"]["train"]["rows"] + manifest["splits"]["eval"]["rows"],
                   output_gib=round(_size(out) / 2**30, 3))
    else:
        row["error"] = result["stderr_tail"]
    return row


def _measured_child(cmd: list[str]) -> dict:
    """``cmd`` as a child whose resource usage is its own (``os.wait4`` on its pid)."""
    started = time.monotonic()
    err_path = os.path.join(REPO, "runs", f".bench_prepare-{os.getpid()}.stderr")
    os.makedirs(os.path.dirname(err_path), exist_ok=True)
    with open(err_path, "w") as err:
        pid = os.posix_spawn(cmd[0], cmd, dict(os.environ, PYTHONPATH=REPO), file_actions=[
            (os.POSIX_SPAWN_DUP2, err.fileno(), 2), (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0)])
        _, status, usage = os.wait4(pid, 0)
    with open(err_path) as f:
        tail = f.read().strip().splitlines()[-3:]
    os.remove(err_path)
    return {"returncode": os.waitstatus_to_exitcode(status), "seconds": time.monotonic() - started,
            "cpu_seconds": usage.ru_utime + usage.ru_stime, "peak_rss_bytes": usage.ru_maxrss * 1024, "stderr_tail": tail}


def format_table(rows: list[dict]) -> str:
    lines = [f"{'events':>12} {'memory limit':>12} {'threads':>7} {'seconds':>8} {'CPU s':>8} {'events/s':>10} "
             f"{'peak RSS GiB':>12} {'samples':>10} {'output GiB':>10}"]
    for r in rows:
        lines.append(f"{r['events']:>12,} {r['memory_limit']:>12} {r['threads']:>7} {r['seconds']:>8.1f} "
                     f"{r.get('cpu_seconds', 0):>8.1f} "
                     f"{r['events_per_s']:>10,} {r['peak_rss_gib']:>12.2f} {r.get('samples', 0):>10,} "
                     f"{r.get('output_gib', 0):>10.2f}" + ("" if r["returncode"] == 0 else f"  FAILED {r.get('error')}"))
    return "\n".join(lines)
