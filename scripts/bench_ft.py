"""Benchmark of the replica layer against synchronous restart under the same failure schedule.

    .venv/bin/python scripts/bench_ft.py [--replicas 2] [--nproc 1] [--steps 1200] [--fail-at 100 600]
        [--checkpoint-every 50] [--restart-delay 1] [--repeats 3] [--set section.key=value ...]

Both variants train ``configs/ft_local.yaml`` (``train.pipeline: sync``) with the same ranks,
the same global batch and the same steps, through ``freescale local``; the variants alternate
within each repetition:

- ``replica_layer``: ``--replicas`` groups of ``--nproc`` ranks; at every step of ``--fail-at``
  one group (the last, then the one before, ...) is SIGKILLed and restarted after
  ``--restart-delay`` seconds; it catches up from a live peer while the others keep training.
- ``sync_restart``: the same ranks as one job (one group of replicas x nproc ranks) saving a
  checkpoint every ``--checkpoint-every`` steps; at every step of ``--fail-at`` the whole job is
  SIGKILLed and, after the same delay, restarted from its last checkpoint (the steps since are
  trained again): what a job without the replica layer does on any failure.

Per run, from the commit log of every group (one line per committed step, with its time):

- effective training time (ETT): the steps' worth of failure-free training over the wall time
  they took, ``steps x median step time / (time of the last step's first commit - start of
  step 1)``; 1.0 is a run that lost nothing;
- stall per failure: the longest time the job made no new progress (no group committed a step
  it had not committed before) around each failure;
- samples lost and repeated, from the ledger of every group.

Results go to ``runs/bench_ft.json``; the table shows means and spread (min-max) and the ratio.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from freescale.local import read_commits, run_local  # noqa: E402
from freescale.io import write_json_atomic  # noqa: E402

CONFIG = os.path.join(REPO, "configs", "ft_local.yaml")
VARIANTS = ("replica_layer", "sync_restart")


def progress_times(run_dir: str, groups: int) -> dict[int, float]:
    """Step -> the first time any group committed it."""
    first: dict[int, float] = {}
    for g in range(groups):
        for c in read_commits(os.path.join(run_dir, f"replica{g}")):
            first[c["step"]] = min(first.get(c["step"], c["time"]), c["time"])
    return first


def measure(run_dir: str, groups: int, steps: int, kills: list[float]) -> dict:
    first = progress_times(run_dir, groups)
    times = [first[s] for s in sorted(first)]
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    step_s = statistics.median(gaps)
    start = first[1] - step_s
    wall = first[steps] - start
    stalls = []
    for t in kills:
        before = max((x for x in times if x <= t), default=start)
        after = min((x for x in times if x > t), default=first[steps])
        stalls.append(after - before)
    return {"ett": round(steps * step_s / wall, 4), "step_ms": round(1e3 * step_s, 2), "wall_s": round(wall, 2),
            "stall_s": [round(s, 3) for s in stalls]}


def run_variant(variant: str, args, overrides: list[str], root: str) -> dict:
    run_dir = os.path.join(root, f"{variant}-{time.time_ns()}")
    common = [*overrides, f"train.steps={args.steps}", "train.ledger=true", "checkpoint.at_end=false"]
    if variant == "replica_layer":
        kills = ",".join(f"{args.replicas - 1 - i % args.replicas}@{s}" for i, s in enumerate(args.fail_at))
        groups, nproc, resume = args.replicas, args.nproc, False
        common += ["checkpoint.every=0"]
    else:
        kills = ",".join(f"0@{s}" for s in args.fail_at)
        groups, nproc, resume = 1, args.replicas * args.nproc, True
        common += [f"checkpoint.every={args.checkpoint_every}"]
    log = io.StringIO()
    summary = run_local(CONFIG, [*common, f"run.dir={run_dir}"], replicas=groups, nproc=nproc, kills=kills,
                        restart_delay=args.restart_delay, resume=resume, out=log, progress_every_s=1e9)
    kill_times = sorted(f["down_at"] for g in summary["groups"] for f in g["failures"])
    result = measure(run_dir, groups, args.steps, kill_times)
    result.update(ledger=summary["ledger"], failures=len(kill_times),
                  exit_codes=[g["exit_code"] for g in summary["groups"]])
    print(f"  {variant:<14} ETT {result['ett']:.3f} | step {result['step_ms']:.1f} ms | wall {result['wall_s']:.1f} s"
          f" | stall per failure {', '.join(f'{s:.2f}' for s in result['stall_s'])} s | lost "
          f"{summary['ledger']['samples_lost']} repeated {summary['ledger']['samples_repeated']}", flush=True)
    return result


def spread(values: list[float]) -> dict:
    return {"mean": round(statistics.fmean(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--fail-at", type=int, nargs="+", default=[100, 600])
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--restart-delay", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for both variants")
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "bench_ft.json"))
    args = parser.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    started = time.time()
    runs = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="bench_ft-") as root:
        for rep in range(args.repeats):
            print(f"repetition {rep + 1}/{args.repeats}", flush=True)
            for variant in (VARIANTS if rep % 2 == 0 else VARIANTS[::-1]):
                runs[variant].append(run_variant(variant, args, args.set, root))
    stats = {v: {"ett": spread([r["ett"] for r in rs]), "step_ms": spread([r["step_ms"] for r in rs]),
                 "stall_s": spread([s for r in rs for s in r["stall_s"]])} for v, rs in runs.items()}
    layer, sync = stats["replica_layer"], stats["sync_restart"]
    print(f"\n{args.replicas} groups x {args.nproc} rank(s), {args.steps} steps, failures at steps {args.fail_at}, "
          f"restart delay {args.restart_delay} s, checkpoint every {args.checkpoint_every} steps (sync restart)")
    print(f"{'variant':<16}{'ETT mean (min-max)':>24}{'stall per failure, s':>26}{'step, ms':>18}")
    for v in VARIANTS:
        s = stats[v]
        print(f"{v:<16}{s['ett']['mean']:>10.3f} ({s['ett']['min']:.3f}-{s['ett']['max']:.3f})"
              f"{s['stall_s']['mean']:>12.2f} ({s['stall_s']['min']:.2f}-{s['stall_s']['max']:.2f})"
              f"{s['step_ms']['mean']:>12.1f}")
    ratio = layer["ett"]["mean"] / sync["ett"]["mean"]
    print(f"ETT replica layer / sync restart: {ratio:.2f}x; stall per failure {sync['stall_s']['mean']:.2f} s -> "
          f"{layer['stall_s']['mean']:.2f} s")
    write_json_atomic(args.out, {"args": vars(args), "runs": runs, "stats": stats, "ett_ratio": round(ratio, 3),
                                 "seconds": round(time.time() - started, 1)})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
