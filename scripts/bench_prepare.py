"""Throughput and peak memory of ``freescale prepare`` on synthetic event logs.

    .venv/bin/python scripts/bench_prepare.py [--events 10000000 100000000] [--memory-limits 1GB 4GB]
                                              [--threads 2] [--max-uih-len 32] [--num-candidates 10]

For each log size it writes a Parquet event log once (``freescale.data.event_log``: heavy-tailed
users, Zipf items, runs/bench_prepare/log-<events>/), then prepares it (ranking) once per memory
limit, each a fresh process measured alone: wall time, events/s and peak RSS (``os.wait4``).
Results go to docs/results/bench_prepare.json: a row per (log size, memory limit), replaced when
run again, so sizes and limits can be run one at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from freescale.data.prepare_bench import ensure_log, format_table, prepare_once  # noqa: E402
from freescale.io import write_json_atomic  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, nargs="+", default=[10_000_000, 100_000_000])
    p.add_argument("--memory-limits", nargs="+", default=["1GB", "4GB"])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--max-uih-len", type=int, default=32)
    p.add_argument("--num-candidates", type=int, default=10)
    p.add_argument("--users-per-event", type=float, default=0.01, help="users = events x this (default 0.01)")
    p.add_argument("--work", default=os.path.join(REPO, "runs", "bench_prepare"))
    p.add_argument("--json", default=os.path.join(REPO, "docs", "results", "bench_prepare.json"))
    args = p.parse_args()
    rows = json.load(open(args.json))["rows"] if os.path.isfile(args.json) else []
    for events in args.events:
        users = max(1, int(events * args.users_per_event))
        log = ensure_log(os.path.join(args.work, f"log-{events}"), events, users=users, items=max(1000, users))
        for limit in args.memory_limits:
            rows = [r for r in rows if (r["events"], r["memory_limit"]) != (events, limit)]
            print(f"prepare {events:,} events, memory limit {limit} ...", flush=True)
            row = prepare_once(log, os.path.join(args.work, f"out-{events}-{limit}"), events=events, memory_limit=limit,
                               threads=args.threads, max_uih_len=args.max_uih_len, num_candidates=args.num_candidates)
            row["users"] = users
            rows.append(row)
            print(format_table([row]).splitlines()[1], flush=True)
    print(format_table(rows))
    write_json_atomic(args.json, {"machine": f"{os.cpu_count()} CPU cores", "rows": rows})
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
