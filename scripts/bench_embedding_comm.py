"""Benchmark of prioritized embedding communication against TorchRec's TrainPipelineSparseDist.

    .venv/bin/python scripts/bench_embedding_comm.py [--ranks 2 4] [--repeats 3] [--steps 40]
        [--rates 0 1 5 20 50 100] [--transport host_staged] [--variants NAME ...] [--set section.key=value ...]
    .venv/bin/python scripts/bench_embedding_comm.py --hosts 2 --link-gbit 3 [--link-sweep 1.5 6] ...

With ``--hosts N`` the ranks are N hosts of one rank each, joined by a link shaped to
``--link-gbit`` Gbit/s per host (``scripts/shaped_hosts.py``: network namespaces, a bridge,
``tc tbf``; needs root), each rank on its own core: every embedding exchange, the balancer's
and the dense all-reduce cross the link, whose bytes take link time and no CPU. That is the
regime prioritized communication is for; on one machine without a link, the exchanges are
memory copies on the cores that compute, and overlapping them hides little. ``--link-sweep``
repeats (a) at other link rates. FreeScale's pipelines then use ``torch_dist`` by default: on a
host of one core, whatever a transport's own threads spend is taken from the rank's compute,
and gloo's spend least (``--transport host_staged`` adds its proxy's).

Every run is a real ``torchrun`` job of ``configs/bench_embedding.yaml`` (a 2M-row item table of
512-float rows projected to a 32-wide model, so the embedding exchanges are a real share of
the step) with bubble profiling on; the variants (``VARIANTS``, or those ``--variants`` names)
alternate within each repetition: ``sparse_dist`` (TorchRec's pipeline), ``sync`` (FreeScale's
own tables updated synchronously, over the same transport: what the transport alone gives),
``prioritized`` (the same tables, collision rows first, ``transport.lanes`` as the config leaves
it: ``auto``, one lane where a rank has one core), ``prioritized_1lane`` and ``prioritized_2lanes``
(the same on a transport of one lane and of two: what the priority lane is worth).

(a) at a low collision rate (``data.synthetic.hot_prob`` 0: about 0.5% of rows), on each rank
    count. Per run: exposed communication per step and step time from the bubble report,
    samples/s, the measured collision rate, and on a link the bound and the distance to it
    (below); then the means with the spread (min-max) and the ratios. For the baseline, the
    share of its step that exposed communication takes. Per variant, where its main thread was
    blocked, by span (``blocked_ms_by_span``: the bubble report's
    ``blocked_ms_per_step_by_span``, the five largest printed), and how much of its exposed
    communication was the main thread waiting for a core (``cpu_wait_ms``: on a host of one
    core, the exchanges' own threads running).
(b) a sweep over the collision rate (targets in percent of the rows batch i+1 reads that batch i
    writes; the hot-item probability that gives each is found from the data first), every
    variant at each rate on the first rank count: how exposed communication grows with it.

**The bound** (with ``--hosts``; ``freescale.profile.comm_bound`` defines it and says what it
leaves out): the exposed communication no schedule goes under on the link, per step,

    bound = t(collision exchange) + max(0, t(rest of the embedding exchange) - compute)

where ``t(b)`` is the link time of ``b`` bytes at ``--link-gbit`` (8 b / rate), the collision
exchange is batch i's gradients of the rows batch i+1 reads and those rows (they cross between
batch i's backward and batch i+1's forward, so nothing hides them), the rest is the ids, the
other rows and the other gradients, which can cross while the rank computes, and compute is the
run's own (the bubble report's compute per step). The bytes are what the run recorded per step
and host (the bubble report's ``exchange_bytes_per_step`` and ``collision_bytes_per_step``, from
the pipelines over FreeScale's own tables); a run that records none (TorchRec's; ``sync`` has no
collision split) takes those of the runs of the same repetition, which train the same batches.
``exposed - bound`` is how far a pipeline's exposed communication is from that limit. Without a
link the exchanges are memory copies on the computing cores and there is no bound ("-").

Results go to ``runs/bench_embedding_comm.json``: per variant and repetition ``exposed_comm_ms``,
``step_ms``, ``samples_per_s``, ``collision_rate``, ``compute_ms``, ``exchange_bytes``,
``collision_bytes`` (``bytes_borrowed``: taken from the repetition's other runs), ``bound_ms``
and ``exposed_minus_bound_ms``, under ``low_collision``, ``sweep`` and (with ``--link-sweep``)
``link_sweep``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from freescale.config import load_config  # noqa: E402
from freescale.data.loader import build_sources  # noqa: E402
from freescale.io import write_json_atomic  # noqa: E402
from freescale.profile.comm_bound import add_bounds  # noqa: E402
from freescale.progress import bar, say  # noqa: E402

sys.path.insert(0, os.path.join(REPO, "scripts"))
from shaped_hosts import ShapedHosts, available  # noqa: E402

CONFIG = os.path.join(REPO, "configs", "bench_embedding.yaml")
DEFAULT_LINK_GBIT = 3.0
"""With --hosts: the link rate at which TorchRec's exposed embedding communication is 25-50% of its step."""
VARIANTS = {
    "sparse_dist": ("sparse_dist", []),
    "pec": ("pec", []),
    "sync": ("sync", []),
    "prioritized": ("prioritized", []),
    "prioritized_1lane": ("prioritized", ["--transport.lanes=1"]),
    "prioritized_2lanes": ("prioritized", ["--transport.lanes=2"]),
}
"""Name: (train.pipeline, overrides). TorchRec's pipeline; TorchRec's PEC modules on the item
table (FreeScale's pipeline for them, corrected: docs/pec.md); FreeScale's tables updated
synchronously over the same transport as the prioritized pipeline (what the transport alone
gives); the prioritized pipeline (lanes: auto); the prioritized pipeline on one lane, on two."""
MEASURES = ("exposed_comm_ms", "bound_ms", "exposed_minus_bound_ms", "step_ms", "samples_per_s", "compute_ms",
            "cpu_wait_ms", "collision_rate")
"""What the tables and the JSON's ``stats`` hold per variant (mean, min, max over the repetitions)."""


def collision_rate(hot_prob: float, ranks: int, overrides: list[str], batches: int = 6) -> float:
    """The item-row collision rate of consecutive global batches at ``hot_prob`` (from the data alone)."""
    cfg = load_config(CONFIG, [*overrides, f"--data.synthetic.hot_prob={hot_prob}"])
    source, _ = build_sources(cfg.data, cfg.run.seed, task=cfg.task)
    n = cfg.data.batch_size * ranks
    rows = []
    for k in range(batches + 1):
        s = source.samples_at(np.arange(k * n, (k + 1) * n))
        rows.append(np.unique(np.concatenate([s.uih_values, s.cand_values])))
    return float(np.mean([np.isin(b, a).mean() for a, b in zip(rows, rows[1:])]))


def hot_prob_for(target: float, ranks: int, overrides: list[str]) -> float:
    """The hot-item probability whose collision rate is closest to ``target`` (bisection)."""
    if target <= 0:
        return 0.0
    if target >= 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(14):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if collision_rate(mid, ranks, overrides) < target else (lo, mid)
    return round((lo + hi) / 2, 5)


def train_once(ranks: int, pipeline: str, steps: int, run_dir: str, extra: list[str], hosts=None) -> dict:
    """One training job (on ``hosts``, one rank each, when given); its figures from the bubble report."""
    args = ["train", "--config", CONFIG, f"--run.dir={run_dir}", f"--train.pipeline={pipeline}",
            f"--train.steps={steps}", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if hosts is None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "-m",
               "freescale", *args]
        procs = [subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)]
    else:
        agents = hosts.torchrun([*args, "--transport.host_name={host}"], run_id=os.path.basename(run_dir), env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        outs = [a.communicate() for a in agents]
        procs = [subprocess.CompletedProcess(a.args, a.returncode, *out) for a, out in zip(agents, outs)]
    failed = [p for p in procs if p.returncode != 0]
    if failed:
        raise SystemExit(f"training failed ({pipeline}, {ranks} ranks):\n{failed[0].stdout[-3000:]}\n"
                         f"{failed[0].stderr[-3000:]}")
    with open(os.path.join(run_dir, "report", "report.json")) as f:
        summary = json.load(f)["summary"]
    cfg = load_config(os.path.join(run_dir, "config.yaml"))
    step_ms = summary["step_ms"]
    return {
        "exposed_comm_ms": summary["exposed_comm_ms_per_step"],
        "step_ms": step_ms,
        "samples_per_s": round(cfg.data.batch_size * ranks / (step_ms / 1000.0), 1),
        "straggler_ms": summary["straggler_bubble_ms_per_step"],
        "compute_ms": summary["compute_ms_per_step"],
        "collision_rate": summary.get("collision_rate"),
        "collision_wait_ms": summary.get("collision_wait_ms_per_step"),
        "exchange_bytes": summary.get("exchange_bytes_per_step"),
        "collision_bytes": summary.get("collision_bytes_per_step"),
        "cpu_wait_ms": summary.get("cpu_wait_ms_per_step"),
        "blocked_ms_by_span": summary.get("blocked_ms_per_step_by_span", {}),
    }


def _stats(runs: list[dict], key: str) -> dict:
    values = [r[key] for r in runs if r.get(key) is not None]
    if not values:
        return {"mean": None, "min": None, "max": None}
    return {"mean": round(float(np.mean(values)), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def _blocked(runs: list[dict]) -> dict[str, float]:
    """Per span kind, the mean over ``runs`` of the main thread's time in it off its CPU (the
    bubble report's ``blocked_ms_per_step_by_span``; a span inside another counts in both),
    largest first: where a pipeline's exposed communication sits."""
    kinds = {kind for r in runs for kind in r["blocked_ms_by_span"]}
    means = {kind: round(float(np.mean([r["blocked_ms_by_span"].get(kind, 0.0) for r in runs])), 3) for kind in kinds}
    return dict(sorted(means.items(), key=lambda kv: -kv[1]))


def _show(s: dict, digits: int = 1) -> str:
    if s["mean"] is None:
        return "-"
    return f"{s['mean']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def _ms(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def compare(ranks: int, repeats: int, steps: int, extra: list[str], tmp: str, label: str, variants: list[str],
            hosts=None, link_gbit: float | None = None) -> dict:
    """``repeats`` runs of each of ``variants`` (alternating) on one setting; their stats and the
    ratios against TorchRec's pipeline and synchronous updates (where those ran)."""
    runs = {v: [] for v in variants}
    progress = bar(total=repeats * len(variants), desc=label, unit="run")
    for rep in range(repeats):
        for v in variants:
            pipeline, overrides = VARIANTS[v]
            runs[v].append(train_once(ranks, pipeline, steps, os.path.join(tmp, f"{label}-{ranks}-{v}-{rep}"),
                                      [*extra, *overrides], hosts))
            progress.update()
        # The repetition's runs trained the same batches: the bytes of one are the others'.
        add_bounds([runs[v][rep] for v in variants], link_gbit)
        for v in variants:
            r = runs[v][rep]
            rate = f"{100 * r['collision_rate']:.1f}%" if r["collision_rate"] is not None else "-"
            say(progress, f"  rep {rep} {v:<17} exposed comm {r['exposed_comm_ms']:6.2f} ms (bound {_ms(r['bound_ms'])}) | "
                f"step {r['step_ms']:7.1f} ms | {r['samples_per_s']:8.1f} samples/s | collision rate {rate}")
    progress.close()
    stats = {v: {k: _stats(runs[v], k) for k in MEASURES} for v in variants}
    row = {"ranks": ranks, "link_gbit": link_gbit, "runs": runs, "stats": stats,
           "blocked_ms_by_span": {v: _blocked(runs[v]) for v in variants}}
    for v in variants:
        top = ", ".join(f"{kind} {ms:.2f}" for kind, ms in list(row["blocked_ms_by_span"][v].items())[:5])
        say(None, f"  {v:<17} blocked in (ms/step, mean of the runs): {top}; waiting for a core (within "
                  f"exposed comm): {_show(stats[v]['cpu_wait_ms'], 2)}")
    if "sparse_dist" in stats and "prioritized" in stats:
        base, ours = stats["sparse_dist"], stats["prioritized"]
        row.update({
            "exposed_comm_reduction_x": round(base["exposed_comm_ms"]["mean"] / max(ours["exposed_comm_ms"]["mean"], 1e-9), 2),
            "samples_per_s_ratio": round(ours["samples_per_s"]["mean"] / base["samples_per_s"]["mean"], 3),
            "baseline_exposed_share": round(base["exposed_comm_ms"]["mean"] / base["step_ms"]["mean"], 3),
            # The range of the ratio: the worst and best pairing of the repetitions.
            "exposed_comm_reduction_range": [
                round(base["exposed_comm_ms"]["min"] / max(ours["exposed_comm_ms"]["max"], 1e-9), 2),
                round(base["exposed_comm_ms"]["max"] / max(ours["exposed_comm_ms"]["min"], 1e-9), 2)],
        })
    if "sync" in stats and "prioritized" in stats:
        row["exposed_comm_reduction_vs_sync_x"] = round(
            stats["sync"]["exposed_comm_ms"]["mean"] / max(stats["prioritized"]["exposed_comm_ms"]["mean"], 1e-9), 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--hosts", type=int, default=0,
                        help="run on this many hosts of one rank each, joined by a shaped link (needs root)")
    parser.add_argument("--link-gbit", type=float, default=DEFAULT_LINK_GBIT,
                        help="with --hosts: each host's egress rate, Gbit/s")
    parser.add_argument("--link-sweep", type=float, nargs="*", default=[],
                        help="with --hosts: other link rates (Gbit/s) at which (a) is repeated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rates", "--collision", type=float, nargs="*", default=[0, 1, 5, 20, 50, 100],
                        help="collision rates (percent) of the sweep; none to skip it")
    parser.add_argument("--sweep-repeats", type=int, default=1)
    parser.add_argument("--transport", default=None,
                        help="transport of FreeScale's pipelines (default: host_staged on one machine, torch_dist "
                             "with --hosts)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), metavar="NAME",
                        help=f"the variants to run (default: all of {', '.join(VARIANTS)})")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every run")
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "bench_embedding_comm.json"))
    args = parser.parse_args()
    if args.hosts:
        ok, why = available()
        if not ok:
            raise SystemExit(why)
        if args.hosts > os.cpu_count():
            raise SystemExit(f"--hosts {args.hosts}: one core per host, and this machine has {os.cpu_count()}")
        args.ranks = [args.hosts]
    if args.transport is None:
        # A host of one core: what a transport's own threads spend is taken from the rank's
        # compute, and gloo's threads spend least (host_staged adds its proxy's).
        args.transport = "torch_dist" if args.hosts else "host_staged"

    overrides = [f"--{kv.removeprefix('--')}" for kv in args.set]
    extra = [*overrides, f"--transport.kind={args.transport}"]
    cfg = load_config(CONFIG, overrides)
    m = cfg.model
    where = (f"{args.hosts} hosts of one rank, links shaped to {args.link_gbit:g} Gbit/s" if args.hosts
             else "one machine")
    print(f"model: {cfg.data.synthetic.num_items:,} items x {m.embedding_dim} floats, d_model {m.d_model or m.embedding_dim}, "
          f"{m.num_layers} layer(s); {cfg.data.batch_size} samples per rank, median UIH {cfg.data.synthetic.median_uih_len:g}; "
          f"prioritized over {args.transport}; {args.steps} steps, {cfg.profile.warmup_steps} of warm-up; {where}")
    started = time.time()
    link = args.link_gbit if args.hosts else None
    result = {"config": CONFIG, "overrides": overrides, "transport": args.transport, "steps": args.steps,
              "repeats": args.repeats, "hosts": args.hosts, "link_gbit": link, "variants": args.variants,
              "low_collision": [], "sweep": [], "link_sweep": []}

    def on_hosts(gbit: float):
        """The shaped hosts of one link rate (nothing without --hosts)."""
        if not args.hosts:
            return contextlib.nullcontext()
        return ShapedHosts(args.hosts, gbit, cpus=[[k] for k in range(args.hosts)])

    with tempfile.TemporaryDirectory() as tmp:
        with on_hosts(args.link_gbit) as hosts:
            for ranks in args.ranks:
                print(f"\n(a) {ranks} ranks, hot_prob 0 (collision rate ~{100 * collision_rate(0.0, ranks, overrides):.1f}%)")
                row = compare(ranks, args.repeats, args.steps, extra, tmp, "low", args.variants, hosts, link)
                result["low_collision"].append(row)
                _print_table(row)
            if args.rates:
                ranks = args.ranks[0]
                print(f"\n(b) collision-rate sweep on {ranks} ranks")
                for target in args.rates:
                    p = hot_prob_for(target / 100, ranks, overrides)
                    print(f" target {target:g}%: hot_prob {p} (data: {100 * collision_rate(p, ranks, overrides):.1f}%)")
                    row = compare(ranks, args.sweep_repeats, args.steps, [*extra, f"--data.synthetic.hot_prob={p}"],
                                  tmp, f"sweep{target:g}", args.variants, hosts, link)
                    row.update(target_pct=target, hot_prob=p)
                    result["sweep"].append(row)
                _print_sweep(result["sweep"], args.variants)
        for gbit in args.link_sweep if args.hosts else []:
            print(f"\n(c) link shaped to {gbit:g} Gbit/s, hot_prob 0")
            with on_hosts(gbit) as hosts:
                row = compare(args.hosts, args.repeats, args.steps, extra, tmp, f"link{gbit:g}", args.variants, hosts,
                              gbit)
            result["link_sweep"].append(row)
            _print_table(row)
    result["seconds"] = round(time.time() - started, 1)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_json_atomic(args.out, result)
    print(f"\nwrote {args.out} ({result['seconds']} s)")


def _rate(stats: dict) -> str:
    rate = stats["collision_rate"]["mean"]
    return "-" if rate is None else f"{100 * rate:.2f}%"


def _print_table(row: dict) -> None:
    s = row["stats"]
    link = f", {row['link_gbit']:g} Gbit/s link" if row.get("link_gbit") else ""
    print(f"\n| variant ({row['ranks']} ranks{link}) | exposed comm ms/step | bound ms | exposed - bound ms | step ms "
          "| samples/s | collision rate |")
    print("|---|---|---|---|---|---|---|")
    for v, st in s.items():
        print(f"| {v} | {_show(st['exposed_comm_ms'], 2)} | {_show(st['bound_ms'], 2)} | "
              f"{_show(st['exposed_minus_bound_ms'], 2)} | {_show(st['step_ms'])} | {_show(st['samples_per_s'])} "
              f"| {_rate(st)} |")
    if "exposed_comm_reduction_x" in row:
        lo, hi = row["exposed_comm_reduction_range"]
        print(f"exposed communication: {row['exposed_comm_reduction_x']:.2f}x lower than TorchRec's (range "
              f"{lo:.2f}-{hi:.2f}x); samples/s ratio {row['samples_per_s_ratio']:.3f}; the baseline's exposed "
              f"communication is {100 * row['baseline_exposed_share']:.0f}% of its step")
    if "exposed_comm_reduction_vs_sync_x" in row:
        print(f"synchronous updates over the same transport / prioritized: {row['exposed_comm_reduction_vs_sync_x']:.2f}")


def _print_sweep(rows: list[dict], variants: list[str]) -> None:
    """Per collision rate, each variant's exposed communication (ms/step) and in brackets its
    distance to the bound (exposed - bound), and TorchRec's over prioritized's."""
    print("\n| target rate | measured rate | " + " | ".join(f"{v}: exposed (- bound) ms" for v in variants)
          + " | TorchRec / prioritized |")
    print("|---|---|" + "---|" * len(variants) + "---|")
    for row in rows:
        s = row["stats"]
        measured = next((_rate(s[v]) for v in variants if s[v]["collision_rate"]["mean"] is not None), "-")
        cells = [f"{_ms(s[v]['exposed_comm_ms']['mean'])} ({_ms(s[v]['exposed_minus_bound_ms']['mean'])})" for v in variants]
        ratio = f"{row['exposed_comm_reduction_x']:.2f}x" if "exposed_comm_reduction_x" in row else "-"
        print(f"| {row['target_pct']:g}% | {measured} | " + " | ".join(cells) + f" | {ratio} |")


if __name__ == "__main__":
    main()
