"""How an owner finds its collision rows: sorting (``torch.isin``), PEC's bitmap, and ``RowMarks``.

    .venv/bin/python scripts/bench_collision_split.py [--shard-rows 1000000] [--ids 4300]
        [--rates 0.5 5 50] [--repeats 200] [--out runs/bench_collision_split.json]

Per step an owner of the prioritized pipeline splits the ids batch i+1 reads on it by whether
batch i wrote them (sorted distinct rows: each is sent once), and marks which of batch i's and
batch i+1's ids are collision rows (the flags it sends back). It used to do it by sorting:
``split_rows`` (``torch.unique`` of both sets, ``torch.isin``) and two ``in_rows``
(``torch.isin``). TorchRec's PEC (``BooleanOverlapChecker``) keeps a boolean buffer of the
shard's rows, zeroes it, sets batch i's ids and reads batch i+1's, twice per step (one mask
per direction), and sends a row per id. ``RowMarks`` takes PEC's bitmap for the same output
as the sorting: a mark per local row, set and read, cleared where set. All three are timed on
the same ids (one thread, the median of ``--repeats``), at the shard size and ids per owner of
``configs/bench_embedding.yaml`` on 2 ranks by default (a 2M-row table; 32 samples of ~128
events and 4 candidates per rank), batch i+1 drawing ``rate`` percent of its ids from batch
i's; the outputs are checked equal first. Prints a table and the ratio; writes JSON.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from freescale.embedding.rows import RowMarks, in_rows, split_rows  # noqa: E402
from freescale.io import write_json_atomic  # noqa: E402


def pec_masks(seen: torch.Tensor, prev: torch.Tensor, cur: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PEC's ``BooleanOverlapChecker.check``: a mask over each batch's ids."""
    seen.zero_()
    seen[prev] = True
    forward = seen[cur].clone()
    seen.zero_()
    seen[cur] = True
    backward = seen[prev].clone()
    return forward, backward


def by_sorting(prev: torch.Tensor, cur: torch.Tensor):
    """The owner's split and flags as the pipeline made them before ``RowMarks``."""
    split = split_rows(prev, cur)
    return split, in_rows(prev, split.collision), in_rows(cur, split.collision)


def by_marks(marks: RowMarks, prev: torch.Tensor, cur: torch.Tensor):
    """The same with ``RowMarks`` (what the pipeline does now)."""
    split = marks.split(prev, cur)
    return (split, *marks.among(split.collision, prev, cur))


def timed(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    return 1e3 * times[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shard-rows", type=int, default=1_000_000)
    parser.add_argument("--ids", type=int, default=4300, help="ids per batch an owner receives")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 5, 50], help="percent of batch i+1's ids "
                        "drawn from batch i's")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "bench_collision_split.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    seen = torch.zeros(args.shard_rows, dtype=torch.bool)  # PEC's (zeroed before each use)
    marks = RowMarks(args.shard_rows)
    rows = []
    print(f"shard of {args.shard_rows:,} rows, {args.ids:,} ids per batch, one thread, median of {args.repeats}")
    print(f"{'rate %':>7} {'sorting ms':>11} {'RowMarks ms':>12} {'PEC bitmap ms':>14} {'RowMarks / sorting':>19} "
          f"{'distinct rows / ids':>20}")
    for rate in args.rates:
        prev = torch.randint(0, args.shard_rows, (args.ids,), generator=g)
        n_from_prev = int(round(args.ids * rate / 100))
        cur = torch.cat([prev[torch.randint(0, args.ids, (n_from_prev,), generator=g)],
                         torch.randint(0, args.shard_rows, (args.ids - n_from_prev,), generator=g)])
        (ref, *ref_flags), (got, *got_flags) = by_sorting(prev, cur), by_marks(marks, prev, cur)
        assert all(torch.equal(getattr(ref, f), getattr(got, f)) for f in ("written", "collision", "exclusive"))
        assert all(torch.equal(a, b) for a, b in zip(ref_flags, got_flags))
        fwd, bwd = pec_masks(seen, prev, cur)
        assert torch.equal(fwd, ref_flags[1]) and torch.equal(bwd, ref_flags[0])  # the same flags, per id
        ms = {"sorting": timed(lambda: by_sorting(prev, cur), args.repeats),
              "row_marks": timed(lambda: by_marks(marks, prev, cur), args.repeats),
              "pec_bitmap": timed(lambda: pec_masks(seen, prev, cur), args.repeats)}
        distinct = len(torch.unique(cur)) / len(cur)
        rows.append({"rate_pct": rate, "ms": ms, "measured_rate": ref.rate, "distinct_per_id": distinct})
        print(f"{rate:>7} {ms['sorting']:>11.3f} {ms['row_marks']:>12.3f} {ms['pec_bitmap']:>14.3f} "
              f"{ms['row_marks'] / ms['sorting']:>18.2f}x {distinct:>20.3f}")
    write_json_atomic(args.out, {"shard_rows": args.shard_rows, "ids": args.ids, "repeats": args.repeats,
                                 "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
