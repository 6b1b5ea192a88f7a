"""Quality of the replica layer's embedding-table averaging at several sync intervals.

    .venv/bin/python scripts/bench_ft_sync.py [--intervals 1 10 100] [--replicas 2] [--steps 1000]
        [--repeats 2] [--set section.key=value ...]

Every replica group updates its own copy of the tables with its own batches; every
``ft.embedding_sync_every`` steps (and at the end) the copies are averaged. This trains
``configs/ft_local.yaml`` as ``--replicas`` groups of one rank at each interval, and as one group
of ``--replicas`` ranks (one replica with the same global batch: the same samples each step,
the tables sharded instead of copied), and compares the held-out AUC and normalized entropy
at the end. The variants alternate within each repetition; repetition k uses ``run.seed`` k
(data and initialization), which gives the spread. Results go to ``runs/bench_ft_sync.json``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from freescale.local import run_local  # noqa: E402
from freescale.io import write_json_atomic  # noqa: E402

CONFIG = os.path.join(REPO, "configs", "ft_local.yaml")


def train(name: str, args, overrides: list[str], replicas: int, nproc: int, root: str) -> dict:
    run_dir = os.path.join(root, f"{name}-{time.time_ns()}")
    summary = run_local(CONFIG, [*overrides, f"run.dir={run_dir}"], replicas=replicas, nproc=nproc, out=io.StringIO(),
                        progress_every_s=1e9)
    if not all(g["exit_code"] == 0 for g in summary["groups"]):
        raise RuntimeError(f"{name}: a group failed; see {run_dir}")
    with open(os.path.join(run_dir, "replica0", "summary.json")) as f:
        final = json.load(f)
    result = {"auc": final["eval/auc"], "ne": final["eval/ne"], "loss": final["eval/loss"]}
    print(f"  {name:<18} auc {result['auc']:.4f} | ne {result['ne']:.4f} | loss {result['loss']:.4f}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--intervals", type=int, nargs="+", default=[1, 10, 100])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every run")
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "bench_ft_sync.json"))
    args = parser.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    started = time.time()
    names = ["one_replica", *(f"sync_every_{k}" for k in args.intervals)]
    runs = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="bench_ft_sync-") as root:
        for rep in range(args.repeats):
            print(f"repetition {rep + 1}/{args.repeats} (run.seed {rep})", flush=True)
            common = [*args.set, f"train.steps={args.steps}", f"run.seed={rep}", "data.eval_samples=4096",
                      "train.eval_every=0", "train.ledger=false", "checkpoint.at_end=false"]
            for name in (names if rep % 2 == 0 else names[::-1]):
                if name == "one_replica":
                    runs[name].append(train(name, args, common, 1, args.replicas, root))
                else:
                    every = name.rsplit("_", 1)[1]
                    runs[name].append(train(name, args, [*common, f"ft.embedding_sync_every={every}"],
                                            args.replicas, 1, root))
    stats = {n: {k: {"mean": round(statistics.fmean(r[k] for r in rs), 5), "min": min(r[k] for r in rs),
                     "max": max(r[k] for r in rs)} for k in ("auc", "ne")} for n, rs in runs.items()}
    print(f"\n{args.replicas} groups x 1 rank against 1 group x {args.replicas} ranks, {args.steps} steps, "
          f"{args.repeats} seeds")
    print(f"{'variant':<18}{'AUC mean (min-max)':>26}{'NE mean (min-max)':>26}")
    for n in names:
        a, e = stats[n]["auc"], stats[n]["ne"]
        print(f"{n:<18}{a['mean']:>10.4f} ({a['min']:.4f}-{a['max']:.4f}){e['mean']:>10.4f} ({e['min']:.4f}-{e['max']:.4f})")
    write_json_atomic(args.out, {"args": vars(args), "runs": runs, "stats": stats,
                                 "seconds": round(time.time() - started, 1)})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
