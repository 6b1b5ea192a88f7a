"""Benchmark of cost-balanced samples.

    .venv/bin/python scripts/bench_balance.py [--repeats 3] [--ranks 2 4] [--steps 40] [--skip-training | --only-hierarchy]

(a) Partition quality and speed: global batches of 64 samples per rank for 8..1024 ranks on
    several length distributions (lognormal; heavy tails up to 2K and 21K; the real per-user
    history lengths of MovieLens-100K, read from the recbole==1.2.1 wheel), every partition:
    imbalance (max rank cost / mean rank cost) and milliseconds (median of ``--repeats`` timed
    runs), with the lower bounds; then, at 1024 ranks, which partitions come within 1% of the
    bound in under 100 ms.
(b) Real training: ``torchrun`` on 2 and 4 CPU ranks (one thread each) with
    ``configs/bench_balance.yaml`` (heavy-tailed UIH up to 2048), the balancer with
    ``contiguous`` against ``karmarkar_karp`` and ``zigzag``, interleaved, each repetition
    printed; straggler % and step time from each run's bubble report, with ratios to
    ``contiguous``.
(c) ``hierarchical`` at 8K, 32K and 100K ranks of 64 samples (up to 6.4M samples a global
    batch): imbalance against the equal-count bound, milliseconds of the whole solve (what
    every rank ran per step before the balancer asked each rank for its view only) and of one
    rank's view (``hierarchical_view`` with the rank's own samples asked: what each rank runs
    now), timed alternately, and ``greedy`` at 8K ranks. ``--only-hierarchy`` runs this alone.

The cost model is ``runs/cost_model-bench_balance.json``, calibrated first if missing.
Results go to ``runs/bench_balance.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from freescale.io import write_json_atomic  # noqa: E402
from freescale.progress import bar, say  # noqa: E402
from freescale.balance.cost import CostModel  # noqa: E402
from freescale.balance.partition import (PARTITIONS, equal_count_bound, evaluate, greedy, hierarchical,  # noqa: E402
                                         hierarchical_view, imbalance, lower_bound)
from freescale.config import SyntheticDataConfig, load_config  # noqa: E402
from freescale.data.ml100k import ensure_ml100k, user_history_lengths  # noqa: E402
from freescale.data.synthetic import sample_uih_lengths  # noqa: E402

CONFIG = os.path.join(REPO, "configs", "bench_balance.yaml")
COST_MODEL = os.path.join(REPO, "runs", "cost_model-bench_balance.json")
PER_RANK = 64
CANDIDATES = 4


def distributions(cache: str) -> dict:
    bench = load_config(CONFIG).data
    ml = user_history_lengths(ensure_ml100k(cache))

    def synthetic(cfg, max_len):
        return lambda n, rng: sample_uih_lengths(cfg, n, 1, max_len, rng)

    return {
        "lognormal": synthetic(SyntheticDataConfig(median_uih_len=32, sigma=1.0, tail_prob=0.0), 2048),
        # The lengths of tests/unit/test_partition.py's 256-rank check.
        "test-heavy": synthetic(SyntheticDataConfig(median_uih_len=64, sigma=1.0, tail_prob=0.05, tail_min_len=256,
                                                    tail_alpha=1.1), 2048),
        "heavy-2K": synthetic(bench.synthetic, bench.max_uih_len),
        "heavy-21K": synthetic(SyntheticDataConfig(median_uih_len=32, sigma=1.0, tail_prob=0.02, tail_min_len=512,
                                                   tail_alpha=1.0), 21000),
        "ml100k": lambda n, rng: rng.choice(ml, size=n, replace=True),
    }


def partition_section(model: CostModel, rank_counts: list[int], cache: str, repeats: int = 3) -> list[dict]:
    rows = []
    names = sorted(PARTITIONS)
    print(f"\n(a) partition quality, {PER_RANK} samples per rank, {CANDIDATES} candidates each")
    print(f"{'lengths':<10}{'ranks':>6}{'bound':>8}{'eq.bound':>9}" + "".join(f"{n:>16}" for n in names)
          + "   (imbalance / ms)")
    for dist_name, draw in distributions(cache).items():
        for ranks in rank_counts:
            lengths = draw(ranks * PER_RANK, np.random.default_rng(ranks))
            costs = model.cost(lengths, np.full(len(lengths), CANDIDATES))
            evaluate(costs, ranks, names)  # warm caches
            timed = [evaluate(costs, ranks, names) for _ in range(repeats)]  # the same result, timed again
            result = timed[0]
            for n in names:
                ms = sorted(1e3 * t[n]["seconds"] for t in timed)
                result[n]["ms"] = {"median": ms[len(ms) // 2], "min": ms[0], "max": ms[-1]}
            cells = "".join(f"{result[n]['imbalance']:>9.3f}/{result[n]['ms']['median']:<6.1f}" for n in names)
            bound, eq = lower_bound(costs, ranks), equal_count_bound(costs, ranks)
            print(f"{dist_name:<10}{ranks:>6}{bound:>8.3f}{eq:>9.3f}{cells}")
            rows.append({"lengths": dist_name, "ranks": ranks, "max_length": int(lengths.max()), "lower_bound": bound,
                         "equal_count_bound": eq, "partitions": result})
    return rows


def scale_check(rows: list[dict], ranks: int = 1024, within: float = 0.01, budget_ms: float = 100.0) -> dict:
    """Per length distribution at ``ranks`` ranks: which partitions land within ``within`` of the
    bound (the larger of the two) in under ``budget_ms`` (median time)."""
    print(f"\nat {ranks} ranks x {PER_RANK} samples: imbalance within {100 * within:.0f}% of the bound "
          f"in under {budget_ms:.0f} ms (median of the timed runs, min-max)")
    out = {}
    for row in (r for r in rows if r["ranks"] == ranks):
        verdicts = {}
        for name, p in row["partitions"].items():
            # Unequal counts (vbs) escape the equal-count bound; only the largest sample binds them.
            bound = row["lower_bound"] if name == "vbs" else max(row["lower_bound"], row["equal_count_bound"])
            ok = p["imbalance"] <= (1 + within) * bound and p["ms"]["median"] < budget_ms
            verdicts[name] = ok
            if name in ("karmarkar_karp", "greedy", "vbs"):
                print(f"  {row['lengths']:<10} {name:<15} {p['imbalance']:.4f} / bound {bound:.4f} "
                      f"({p['imbalance'] / bound - 1:+.2%}) in {p['ms']['median']:.1f} ms "
                      f"({p['ms']['min']:.1f}-{p['ms']['max']:.1f}) {'yes' if ok else 'no'}")
        out[row["lengths"]] = verdicts
    return out


def _timed_alternately(fns: dict, repeats: int) -> tuple[dict, dict]:
    """Each of ``fns``' result and its milliseconds over ``repeats`` rounds that call every one
    once, in turn, after one warm-up each (so a slow stretch of the machine hits them alike):
    wall time, and the process's CPU time (``cpu``: what a machine shared with other jobs
    changes least; the solves run on one thread)."""
    results = {name: fn() for name, fn in fns.items()}
    wall, cpu = {name: [] for name in fns}, {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(1e3 * (time.perf_counter() - start))
            cpu[name].append(1e3 * (time.process_time() - start_cpu))
    stats = {}
    for name in fns:
        w, c = sorted(wall[name]), sorted(cpu[name])
        stats[name] = {"median": w[len(w) // 2], "min": w[0], "max": w[-1],
                       "cpu": {"median": c[len(c) // 2], "min": c[0], "max": c[-1]}}
    return results, stats


def hierarchy_section(model: CostModel, rank_counts: list[int], cache: str, repeats: int = 3,
                      greedy_up_to: int = 8192) -> list[dict]:
    """``hierarchical`` at 8K-100K ranks: the whole solve and one rank's view (what each rank
    runs every step), timed alternately, and ``greedy`` over the whole batch where it still
    fits (up to ``greedy_up_to`` ranks), against the equal-count bound."""
    print(f"\n(c) hierarchical (hosts of 8 ranks) at scale, {PER_RANK} samples per rank: imbalance / wall ms "
          f"(median of {repeats}, whole and view alternately)")
    print(f"{'lengths':<10}{'ranks':>7}{'samples':>9}{'bound':>8}{'hierarchical':>20}{'one view':>12}{'greedy':>20}")
    rows = []
    for dist_name, draw in distributions(cache).items():
        for ranks in rank_counts:
            lengths = draw(ranks * PER_RANK, np.random.default_rng(ranks))
            costs = model.cost(lengths, np.full(len(lengths), CANDIDATES))
            bound = max(lower_bound(costs, ranks), equal_count_bound(costs, ranks))
            rank = ranks // 2
            own = np.arange(rank * PER_RANK, (rank + 1) * PER_RANK)  # the samples it sends
            results, ms = _timed_alternately({"whole": lambda: hierarchical(costs, ranks),
                                              "view": lambda: hierarchical_view(costs, ranks, rank, own)}, repeats)
            parts, whole_ms, rank_ms = results["whole"], ms["whole"], ms["view"]
            if not np.array_equal(results["view"].part, parts[rank]):
                raise SystemExit(f"hierarchical_view disagrees with the whole solve ({dist_name}, {ranks} ranks)")
            row = {"lengths": dist_name, "ranks": ranks, "samples": len(costs), "bound": bound,
                   "hierarchical": {"imbalance": imbalance(costs, parts), "ms": whole_ms},
                   "hierarchical_view": {"ms": rank_ms}}
            cell = "-"
            if ranks <= greedy_up_to:
                g, g_ms = _timed_alternately({"greedy": lambda: greedy(costs, ranks)}, max(1, repeats // 2))
                g, g_ms = g["greedy"], g_ms["greedy"]
                row["greedy"] = {"imbalance": imbalance(costs, g), "ms": g_ms}
                cell = f"{row['greedy']['imbalance']:.4f}/{g_ms['median']:.0f}"
            h = row["hierarchical"]
            print(f"{dist_name:<10}{ranks:>7}{len(costs):>9}{bound:>8.4f}"
                  f"{h['imbalance']:>11.4f}/{whole_ms['median']:<8.0f}{rank_ms['median']:>8.0f} ms{cell:>20}"
                  f"   ({h['imbalance'] / bound - 1:+.2%} of the bound; CPU ms whole {whole_ms['cpu']['median']:.0f}, "
                  f"view {rank_ms['cpu']['median']:.0f})", flush=True)
            rows.append(row)
    return rows


def training_bound(model: CostModel, ranks: int, steps: int) -> float:
    """Mean over the run's global batches of the partition lower bound (equal counts)."""
    from freescale.data.loader import build_sources

    cfg = load_config(CONFIG)
    train, _ = build_sources(cfg.data, cfg.run.seed, task=cfg.task)
    n = cfg.data.batch_size * ranks
    bounds = []
    for k in range(steps):
        s = train.samples_at(np.arange(k * n, (k + 1) * n))
        costs = model.cost(s.uih_lengths, s.cand_counts)
        bounds.append(max(lower_bound(costs, ranks), equal_count_bound(costs, ranks)))
    return float(np.mean(bounds))


def train_once(ranks: int, partition: str, steps: int, run_dir: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "-m", "freescale",
           "train", "--config", CONFIG, f"--run.dir={run_dir}", f"--balance.partition={partition}",
           f"--balance.cost_model={COST_MODEL}", f"--train.steps={steps}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"training failed ({partition}, {ranks} ranks):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "report", "report.json")) as f:
        summary = json.load(f)["summary"]
    return {"straggler_pct": summary["straggler_pct"], "step_ms": summary["step_ms"],
            "bubble_fraction": summary["bubble_fraction"], "exposed_comm_ms_per_step": summary["exposed_comm_ms_per_step"],
            "data_wait_ms_per_step": summary["data_wait_ms_per_step"]}


def training_section(model: CostModel, rank_counts: list[int], repeats: int, steps: int) -> list[dict]:
    partitions = ["contiguous", "karmarkar_karp", "zigzag"]
    out = []
    for ranks in rank_counts:
        bound = training_bound(model, ranks, steps)
        print(f"\n(b) training on {ranks} CPU ranks (one thread each), {steps} steps, "
              f"mean partition lower bound {bound:.4f}")
        runs = {p: [] for p in partitions}
        progress = bar(total=repeats * len(partitions), desc=f"bench_balance {ranks} ranks", unit="run")
        with tempfile.TemporaryDirectory() as tmp:
            for rep in range(repeats):
                for p in partitions:
                    r = train_once(ranks, p, steps, os.path.join(tmp, f"{ranks}-{p}-{rep}"))
                    runs[p].append(r)
                    progress.update()
                    say(progress, f"  rep {rep} {p:<15} straggler {r['straggler_pct']:6.2f}% | step {r['step_ms']:7.1f} ms"
                        f" | bubble fraction {r['bubble_fraction']:.3f} | data wait {r['data_wait_ms_per_step']:.2f} ms")
        progress.close()
        base = runs["contiguous"]
        mean = lambda rs, k: float(np.mean([r[k] for r in rs]))
        print(f"\n| partition ({ranks} ranks) | straggler % | step ms | straggler reduction (contiguous / this) | step time (this / contiguous) |")
        print("|---|---|---|---|---|")
        rows = []
        for p in partitions:
            s, t = mean(runs[p], "straggler_pct"), mean(runs[p], "step_ms")
            s_ratio = mean(base, "straggler_pct") / s if s > 0 else float("inf")
            t_ratio = t / mean(base, "step_ms")
            print(f"| {p} | {s:.2f} | {t:.1f} | {s_ratio:.2f}x | {t_ratio:.3f} |")
            rows.append({"partition": p, "straggler_pct": s, "step_ms": t, "straggler_reduction_x": s_ratio,
                         "step_time_ratio": t_ratio, "runs": runs[p]})
        out.append({"ranks": ranks, "steps": steps, "lower_bound": bound, "partitions": rows})
    return out


def ensure_cost_model() -> CostModel:
    if not os.path.exists(COST_MODEL):
        print(f"calibrating the cost model into {COST_MODEL}", flush=True)
        subprocess.run([sys.executable, "-m", "freescale", "calibrate", "--config", CONFIG, "--out", COST_MODEL],
                       cwd=REPO, check=True)
    model = CostModel.load(COST_MODEL)
    print(f"cost model: {model.a:.3g}*L + {model.b:.3g}*L^2 + {model.c:.3g}*C + {model.d:.3g} s "
          f"(R^2 {model.fit.get('r2', float('nan')):.4f})")
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="rank counts for the training section")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip-training", action="store_true", help="only the partition sections (a) and (c), no training (about 70 s on 2 cores)")
    parser.add_argument("--only-hierarchy", action="store_true", help="only section (c), hierarchical at scale")
    parser.add_argument("--hierarchy-ranks", type=int, nargs="+", default=[8192, 32768, 100000],
                        help="rank counts of section (c)")
    parser.add_argument("--cache", default=os.path.join(REPO, "runs", "cache"), help="where the ML-100K wheel is kept")
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "bench_balance.json"))
    args = parser.parse_args()

    started = time.time()
    model = ensure_cost_model()
    result = {"cost_model": {k: getattr(model, k) for k in "abcd"}}
    if not args.only_hierarchy:
        result["partitions"] = partition_section(model, [8, 32, 128, 256, 1024], args.cache, args.repeats)
        result["scale_check"] = scale_check(result["partitions"])
    result["hierarchy"] = hierarchy_section(model, args.hierarchy_ranks, args.cache, args.repeats)
    if not (args.skip_training or args.only_hierarchy):
        result["training"] = training_section(model, args.ranks, args.repeats, args.steps)
    result["seconds"] = round(time.time() - started, 1)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_json_atomic(args.out, result)
    print(f"\nwrote {args.out} ({result['seconds']} s)")


if __name__ == "__main__":
    main()
