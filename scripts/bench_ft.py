"""Benchmark of the replica layer against synchronous restart: goodput and quality under failures.

    .venv/bin/python scripts/bench_ft.py [--data ml100k|synthetic] [--replicas 2] [--nproc 1] [--steps 1200]
        [--fail-at 100 600] [--checkpoint-every 50] [--restart-delay 1] [--repeats 3]
        [--shardings replicate fsdp] [--set section.key=value ...] [--out PATH]

Both variants train ``configs/ft_local.yaml``'s model (``train.pipeline: sync``) with the same
ranks, the same global batch and the same steps, through ``freescale local``, on MovieLens-100K
(``--data ml100k``, the default: histories cut to 128 events; its held-out AUC moves little
between runs) or the config's synthetic data:

- ``replica_layer``: ``--replicas`` groups of ``--nproc`` ranks; at every step of ``--fail-at``
  one group (the last, then the one before, ...) is SIGKILLed and restarted after
  ``--restart-delay`` seconds; it catches up from a live peer while the others keep training.
- ``sync_restart``: the same ranks as one job (one group of replicas x nproc ranks) saving a
  checkpoint every ``--checkpoint-every`` steps; at every step of ``--fail-at`` the whole job is
  SIGKILLed and, after the same delay, restarted from its last checkpoint (the steps since are
  trained again): what a job without the replica layer does on any failure.

Each variant runs clean (no failure) and under the failures; per repetition the four runs
alternate in order. Per run, from every group's ledger and commit log:

- samples per second: the samples in the trained model (every group's ledger, which keeps a
  batch once however often it was trained) over the wall time from the start of step 1 to the
  first commit of the last step;
- goodput: a variant's samples per second under the failures over the same variant's clean
  samples per second (1.0: the failures cost nothing). A step the replica layer commits while
  a group is down carries that step's surviving groups' samples only, and counts as such;
- stall per failure: the longest time the job committed no new step around each failure;
- held-out AUC and NE at the end (``data.eval_samples`` held-out samples), to be read against
  the spread of the clean runs.

``--shardings replicate fsdp`` runs all of it for each ``dense.sharding`` (``--nproc`` of 2 or
more: ``fsdp`` shards the dense part over a group's ranks), the shardings alternating in every
repetition, and adds each sharding's clean step time to the table: goodput with the dense part
sharded inside the groups, and what the sharding costs per step, from one invocation.

Results go to ``--out`` (default ``runs/bench_ft.json``); the table shows means and spread.
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

from freescale.io import write_json_atomic  # noqa: E402
from freescale.progress import bar, say  # noqa: E402
from freescale.local import read_commits, run_local  # noqa: E402
from freescale.train.ledger import read_ledger  # noqa: E402

CONFIG = os.path.join(REPO, "configs", "ft_local.yaml")
DATA = {"ml100k": ["data.source=ml100k", "data.ratings.cache=runs/cache", "data.max_uih_len=128"], "synthetic": []}
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
    step_s = statistics.median(b - a for a, b in zip(times, times[1:]))
    start = first[1] - step_s
    wall = first[steps] - start
    stalls = []
    for t in kills:
        before = max((x for x in times if x <= t), default=start)
        after = min((x for x in times if x > t), default=first[steps])
        stalls.append(after - before)
    samples = sum(len(r["sample_ids"]) for g in range(groups) for r in read_ledger(os.path.join(run_dir, f"replica{g}")))
    return {"samples": samples, "wall_s": round(wall, 2), "samples_per_s": round(samples / wall, 2),
            "step_ms": round(1e3 * step_s, 2), "stall_s": [round(s, 3) for s in stalls]}


def run_variant(variant: str, failures: bool, args, overrides: list[str], root: str) -> dict:
    run_dir = os.path.join(root, f"{variant}-{'failures' if failures else 'clean'}-{time.time_ns()}")
    common = [*DATA[args.data], *overrides, f"train.steps={args.steps}", "train.ledger=true",
              "checkpoint.at_end=false", f"data.eval_samples={args.eval_samples}"]
    if variant == "replica_layer":
        kills = ",".join(f"{args.replicas - 1 - i % args.replicas}@{s}" for i, s in enumerate(args.fail_at))
        groups, nproc, resume = args.replicas, args.nproc, False
    else:
        kills = ",".join(f"0@{s}" for s in args.fail_at)
        groups, nproc, resume = 1, args.replicas * args.nproc, True
    common += [f"checkpoint.every={args.checkpoint_every}"]
    summary = run_local(CONFIG, [*common, f"run.dir={run_dir}"], replicas=groups, nproc=nproc,
                        kills=kills if failures else "", restart_delay=args.restart_delay, resume=resume, out=io.StringIO(),
                        progress_every_s=1e9)
    if not all(g["exit_code"] == 0 for g in summary["groups"]):
        raise RuntimeError(f"{variant}: a group failed; see {run_dir}")
    kill_times = sorted(f["down_at"] for g in summary["groups"] for f in g["failures"])
    result = measure(run_dir, groups, args.steps, kill_times)
    with open(os.path.join(run_dir, "replica0", "summary.json")) as f:
        final = json.load(f)
    result.update(auc=final["eval/auc"], ne=final["eval/ne"], ledger=summary["ledger"], failures=len(kill_times))
    ledger = summary["ledger"]
    print(f"  {variant:<14} {'failures' if failures else 'clean':<9} {result['samples_per_s']:8.1f} samples/s | "
          f"{result['samples']} samples in {result['wall_s']:.1f} s | stall per failure "
          f"{', '.join(f'{s:.2f}' for s in result['stall_s']) or '-'} s | auc {result['auc']:.4f} ne {result['ne']:.4f} | "
          f"lost {ledger['samples_lost']} repeated {ledger['samples_repeated']}", flush=True)
    return result


def spread(values: list[float]) -> dict:
    return {"mean": round(statistics.fmean(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def variant_stats(runs: dict) -> dict:
    """Per variant: goodput (failures over clean, repetition by repetition), samples/s, stall,
    clean step time, AUC and NE."""
    stats = {}
    for v in VARIANTS:
        clean, failed = runs[f"{v}/clean"], runs[f"{v}/failures"]
        stats[v] = {
            "goodput": spread([f["samples_per_s"] / c["samples_per_s"] for c, f in zip(clean, failed)]),
            "samples_per_s_clean": spread([c["samples_per_s"] for c in clean]),
            "samples_per_s_failures": spread([f["samples_per_s"] for f in failed]),
            "stall_s": spread([s for f in failed for s in f["stall_s"]]),
            "step_ms_clean": spread([c["step_ms"] for c in clean]),
            "auc_clean": spread([c["auc"] for c in clean]), "auc_failures": spread([f["auc"] for f in failed]),
            "ne_clean": spread([c["ne"] for c in clean]), "ne_failures": spread([f["ne"] for f in failed]),
        }
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", choices=list(DATA), default="ml100k")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--fail-at", type=int, nargs="+", default=[100, 600])
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--restart-delay", type=float, default=1.0)
    parser.add_argument("--eval-samples", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shardings", nargs="+", choices=["replicate", "fsdp"], default=None,
                        help="run everything once per dense.sharding, alternating (default: the config's)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every run")
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "bench_ft.json"))
    args = parser.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    started = time.time()
    shardings = args.shardings or [None]
    order = [(v, f) for v in VARIANTS for f in (False, True)]
    runs = {sh: {f"{v}/{'failures' if f else 'clean'}": [] for v, f in order} for sh in shardings}
    progress = bar(total=args.repeats * len(order) * len(shardings), desc="bench_ft", unit="run")
    with tempfile.TemporaryDirectory(prefix="bench_ft-") as root:
        for rep in range(args.repeats):
            say(progress, f"repetition {rep + 1}/{args.repeats}")
            for sharding in (shardings if rep % 2 == 0 else shardings[::-1]):
                overrides = [*args.set, *([f"dense.sharding={sharding}"] if sharding else [])]
                if sharding:
                    say(progress, f"dense.sharding: {sharding}")
                for variant, failures in (order if rep % 2 == 0 else order[::-1]):
                    runs[sharding][f"{variant}/{'failures' if failures else 'clean'}"].append(
                        run_variant(variant, failures, args, overrides, root))
                    progress.update()
    progress.close()
    stats = {sh: variant_stats(runs[sh]) for sh in shardings}
    print(f"\n{args.data}: {args.replicas} groups x {args.nproc} rank(s), {args.steps} steps, failures at steps {args.fail_at}, "
          f"restart delay {args.restart_delay} s, checkpoint every {args.checkpoint_every} steps")
    print(f"{'variant':<15}{'sharding':<11}{'goodput (min-max)':>22}{'stall per failure, s':>25}{'step ms clean':>20}"
          f"{'AUC clean':>20}{'AUC failures':>20}")
    for sharding in shardings:
        for v in VARIANTS:
            s = stats[sharding][v]
            print(f"{v:<15}{sharding or '(config)':<11}{s['goodput']['mean']:>10.3f} ({s['goodput']['min']:.3f}-{s['goodput']['max']:.3f})"
                  f"{s['stall_s']['mean']:>12.2f} ({s['stall_s']['min']:.2f}-{s['stall_s']['max']:.2f})"
                  f"{s['step_ms_clean']['mean']:>9.1f} ({s['step_ms_clean']['min']:.1f}-{s['step_ms_clean']['max']:.1f})"
                  f"{s['auc_clean']['mean']:>9.4f} ({s['auc_clean']['min']:.3f}-{s['auc_clean']['max']:.3f})"
                  f"{s['auc_failures']['mean']:>9.4f} ({s['auc_failures']['min']:.3f}-{s['auc_failures']['max']:.3f})")
        ratio = stats[sharding]["replica_layer"]["goodput"]["mean"] / stats[sharding]["sync_restart"]["goodput"]["mean"]
        print(f"goodput replica layer / sync restart{f' ({sharding})' if sharding else ''}: {ratio:.2f}x")
    if args.shardings and set(shardings) == {"replicate", "fsdp"}:
        step = {sh: stats[sh]["replica_layer"]["step_ms_clean"]["mean"] for sh in shardings}
        print(f"replica layer step time fsdp / replicate (clean): {step['fsdp'] / step['replicate']:.2f}x")
    if not args.shardings:
        runs, stats = runs[None], stats[None]
        ratio = stats["replica_layer"]["goodput"]["mean"] / stats["sync_restart"]["goodput"]["mean"]
    else:
        ratio = {sh: round(stats[sh]["replica_layer"]["goodput"]["mean"] / stats[sh]["sync_restart"]["goodput"]["mean"], 3)
                 for sh in shardings}
    write_json_atomic(args.out, {"args": vars(args), "runs": runs, "stats": stats,
                                 "goodput_ratio": ratio if isinstance(ratio, dict) else round(ratio, 3),
                                 "seconds": round(time.time() - started, 1)})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
