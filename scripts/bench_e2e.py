"""FreeScale against TorchRec end to end: the two shipped experiments on the same model and data.

    .venv/bin/python scripts/bench_e2e.py [--data synthetic ml100k] [--models transformer hstu] [--layouts 2 4 2x2 2h]
        [--link-gbit 3] [--repeats 3] [--steps 40] [--warmup 8] [--variants NAME ...] [--set section.key=value ...]
        [--out PATH]

``configs/baseline_torchrec.yaml`` (contiguous slices, TorchRec's TrainPipelineSparseDist,
torch_dist) against ``configs/freescale.yaml`` (the balancer, the prioritized pipeline,
host_staged), and the variants of them in ``VARIANTS`` (``freescale_1lane`` and
``freescale_2lanes``: FreeScale's experiment with ``transport.lanes`` 1 and 2 instead of
``auto``, the prioritized pipeline without and with its priority lane), on
each data source (``synthetic``: the configs' heavy-tailed histories;
``ml100k``: the data section of ``configs/ml100k.yaml``, MovieLens-100K), each model
(``transformer``: the configs' own; ``hstu``: the model section of ``configs/hstu_ranking.yaml``,
HSTU ranking with the candidates appended to the history, in both experiments) and each layout
(``2`` and ``4``: one torchrun job of that many CPU ranks; ``2x2``: ``freescale local`` with 2
replica groups of 2 ranks, the replica layer on; ``2h``: 2 hosts of one rank each, on a core of
their own, joined by a link shaped to ``--link-gbit`` Gbit/s by ``scripts/shaped_hosts.py``,
which needs root: every exchange between the ranks crosses the link). Every run is a real job with bubble
profiling; the two experiments alternate within each repetition, and repetition k trains
with ``run.seed = k`` in both (so the held-out AUC and NE have a run-to-run spread to be
compared against).

Per run, after the warm-up steps: samples/s (all groups together), bubble fraction,
straggler %, exposed communication per step, on a shaped link (``Nh``) its bound and the
distance to it (``bound_ms``, ``exposed_minus_bound_ms``), training MFLOPs per sample and MFU
(from the bubble report, of group 0 in a 2x2 run; docs/profiling.md defines them), then
held-out AUC and NE at the end. The tables show means with the spread (min-max) and each
variant / baseline ratios; the JSON (``--out``) holds every run, and per row under
``vs_baseline`` each variant's ratios and verdicts. A row holds when FreeScale's samples/s is
higher, its bubble fraction lower, and its AUC and NE no worse than the baseline's run-to-run
spread (inside it, or past it on the better side: both verdicts are kept,
``quality_within_spread`` and ``quality_no_worse``). The last repetition's first pair is also
compared side by side with ``freescale report A B`` into ``<out without .json>_report/``.

**The bound** (``freescale.profile.comm_bound`` defines it): the exposed communication no
schedule goes under on the link, per step: the link time of the collision exchange (batch i's
gradients of the rows batch i+1 reads, and those rows: they cross between batch i's backward
and batch i+1's forward), plus whatever link time of the rest of the embedding exchange (ids,
other rows, other gradients) exceeds the run's compute per step. The bytes are the bubble
report's per step and host (``exchange_bytes_per_step``, ``collision_bytes_per_step``), which
the prioritized pipeline records; a run without them (TorchRec's) takes those of the same
repetition's runs, which train the same global batches (the balancer only splits them across
the ranks otherwise). On one machine ("-") there is no link to bound.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from freescale.io import write_json_atomic  # noqa: E402
from freescale.profile.comm_bound import add_bounds  # noqa: E402
from freescale.progress import bar, say  # noqa: E402

sys.path.insert(0, os.path.join(REPO, "scripts"))
from shaped_hosts import ShapedHosts, available  # noqa: E402

EXPERIMENTS = {"baseline": os.path.join(REPO, "configs", "baseline_torchrec.yaml"),
               "freescale": os.path.join(REPO, "configs", "freescale.yaml")}
ML100K = os.path.join(REPO, "configs", "ml100k.yaml")
HSTU = os.path.join(REPO, "configs", "hstu_ranking.yaml")
VARIANTS = {
    "baseline": ("baseline", []),
    "baseline_pec": ("baseline", ["--train.pipeline=pec"]),
    "freescale": ("freescale", []),
    "freescale_1lane": ("freescale", ["--transport.lanes=1"]),
    "freescale_2lanes": ("freescale", ["--transport.lanes=2"]),
}
"""Name: (experiment, overrides). The first is the baseline the others are compared with;
``freescale`` is the one whose verdicts make a row hold."""
BASELINE, HEADLINE = "baseline", "freescale"
MEASURES = ("samples_per_s", "bubble_fraction", "straggler_pct", "exposed_comm_ms", "bound_ms", "exposed_minus_bound_ms",
            "step_ms", "mflop_per_sample", "mfu_pct", "auc", "ne")
HIGHER_IS_BETTER = {"samples_per_s", "mfu_pct", "auc"}


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _flatten(section: dict, prefix: str) -> list[str]:
    out = []
    for key, value in section.items():
        if isinstance(value, dict):
            out += _flatten(value, f"{prefix}.{key}")
        else:
            out.append(f"--{prefix}.{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}")
    return out


SECTIONS = {"data": {"synthetic": None, "ml100k": ML100K}, "models": {"transformer": None, "hstu": HSTU}}
"""Per option, its choices and the config whose section (``data``, ``model``) each takes (None:
the experiments' own)."""


def section_overrides(option: str, choice: str) -> list[str]:
    """What each experiment's config is run with for ``--<option> <choice>``."""
    choices = SECTIONS[option]
    if choice not in choices:
        raise SystemExit(f"--{option}: unknown choice '{choice}' (expected {' or '.join(choices)})")
    if choices[choice] is None:
        return []
    section = "data" if option == "data" else "model"
    with open(choices[choice]) as f:
        return _flatten(yaml.safe_load(f)[section], section)


LINK_GBIT = 3.0
"""The shaped hosts' link rate (Gbit/s per host's egress) by default."""


def _on_hosts(layout: str, cmd_args: list[str], env: dict, link_gbit: float) -> subprocess.CompletedProcess:
    """``freescale ARGS`` on N shaped hosts of one rank each (layout ``Nh``)."""
    hosts = int(layout[:-1])
    with ShapedHosts(hosts, link_gbit, cpus=[[k % (os.cpu_count() or 1)] for k in range(hosts)]) as shaped:
        agents = shaped.torchrun([*cmd_args, "--transport.host_name={host}"], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        outs = [a.communicate() for a in agents]
    failed = [(a, out) for a, out in zip(agents, outs) if a.returncode]
    a, out = failed[0] if failed else (agents[0], outs[0])
    return subprocess.CompletedProcess(a.args, a.returncode, *out)


def run_once(experiment: str, layout: str, run_dir: str, overrides: list[str], link_gbit: float = LINK_GBIT) -> dict:
    """One training job; its measures."""
    config = EXPERIMENTS[experiment]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = None
    if layout.endswith("h"):
        replicas = 1
        group_dirs = [run_dir]
        proc = _on_hosts(layout, ["train", "--config", config, f"--run.dir={run_dir}", *overrides], env, link_gbit)
    elif "x" in layout:
        replicas, nproc = (int(x) for x in layout.split("x"))
        cmd = [sys.executable, "-m", "freescale", "local", "--config", config, "--replicas", str(replicas),
               "--nproc", str(nproc), f"--run.dir={run_dir}", *overrides]
        group_dirs = [os.path.join(run_dir, f"replica{r}") for r in range(replicas)]
    else:
        replicas, nproc = 1, int(layout)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
               "freescale", "train", "--config", config, f"--run.dir={run_dir}", *overrides]
        group_dirs = [run_dir]
    proc = proc or subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{experiment} on {layout} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-3000:]}")
    summaries = [read_json(os.path.join(d, "summary.json")) for d in group_dirs]
    with open(os.path.join(group_dirs[0], "config.yaml")) as f:
        batch = yaml.safe_load(f)["data"]["batch_size"]
    b = summaries[0]["bubbles"]
    return {
        "samples_per_s": round(sum(batch * s["ranks"] / (s["bubbles"]["step_ms"] / 1000.0) for s in summaries), 1),
        "bubble_fraction": b["bubble_fraction"],
        "straggler_pct": b["straggler_pct"],
        "exposed_comm_ms": b["exposed_comm_ms_per_step"],
        "compute_ms": b["compute_ms_per_step"],
        "exchange_bytes": b.get("exchange_bytes_per_step"),
        "collision_bytes": b.get("collision_bytes_per_step"),
        "step_ms": b["step_ms"],
        "mflop_per_sample": round(b["train_flop_per_sample"] / 1e6, 4),
        "mfu_pct": b["mfu_pct"],
        "auc": summaries[0]["eval/auc"],
        "ne": summaries[0]["eval/ne"],
        "wall_s": round(summaries[0]["wall_s"], 1),
        "run_dir": group_dirs[0],
    }


def common_overrides(steps: int, warmup: int, extra: list[str] = ()) -> list[str]:
    """What every measured run sets: its length, no evaluation or checkpoints, one thread."""
    return [f"--train.steps={steps}", "--train.eval_every=0", "--checkpoint.every=0", "--checkpoint.at_end=false",
            "--run.threads=1", f"--profile.warmup_steps={warmup}", f"--run.log_every={max(steps // 4, 1)}",
            *(f"--{kv.removeprefix('--')}" for kv in extra)]


def _stats(values: list[float | None]) -> dict:
    """Mean, min and max of the values given (None where none is)."""
    values = [v for v in values if v is not None]
    if not values:
        return {"mean": None, "min": None, "max": None}
    return {"mean": float(np.mean(values)), "min": float(min(values)), "max": float(max(values))}


def _against(base: dict, ours: dict) -> dict:
    """One variant's stats against the baseline's: ratios of the means, and the verdicts."""
    ratios = {m: ours[m]["mean"] / base[m]["mean"] if base[m]["mean"] and ours[m]["mean"] is not None else None
              for m in MEASURES}
    within, no_worse = {}, {}
    for m, better in (("auc", 1.0), ("ne", -1.0)):
        # "Within the baseline's run-to-run spread": the variant's mean lies inside the baseline's
        # min-max, widened to at least the baseline's own range on either side of its mean.
        # "No worse": it is not past that spread on the losing side (AUC below, NE above).
        half = max(base[m]["max"] - base[m]["mean"], base[m]["mean"] - base[m]["min"])
        delta = ours[m]["mean"] - base[m]["mean"]
        within[m] = abs(delta) <= half
        no_worse[m] = better * delta >= -half
    return {
        "ratios": ratios,
        "faster": ours["samples_per_s"]["mean"] > base["samples_per_s"]["mean"],
        "fewer_bubbles": ours["bubble_fraction"]["mean"] < base["bubble_fraction"]["mean"],
        "quality_within_spread": within,
        "quality_no_worse": no_worse,
    }


def compare(runs: dict[str, list[dict]]) -> dict:
    """Means and spread per variant, and each variant against the baseline (``vs_baseline``)."""
    stats = {v: {m: _stats([r[m] for r in rs]) for m in MEASURES} for v, rs in runs.items()}
    return {"stats": stats, "vs_baseline": {v: _against(stats[BASELINE], s) for v, s in stats.items() if v != BASELINE}}


def holds(row: dict) -> bool:
    """FreeScale faster, with fewer bubbles, and held-out quality no worse than the baseline's spread."""
    ours = row["vs_baseline"][HEADLINE]
    return ours["faster"] and ours["fewer_bubbles"] and all(ours["quality_no_worse"].values())


def _quality_words(against: dict, m: str) -> str:
    if against["quality_within_spread"][m]:
        return "within"
    return "BETTER than" if against["quality_no_worse"][m] else "WORSE than"


def _cell(s: dict, digits: int) -> str:
    if s["mean"] is None:
        return "-"
    return f"{s['mean']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def print_table(source: str, layout: str, row: dict) -> None:
    digits = {"samples_per_s": 0, "bubble_fraction": 3, "straggler_pct": 1, "exposed_comm_ms": 1, "bound_ms": 1,
              "exposed_minus_bound_ms": 1, "step_ms": 0, "mflop_per_sample": 3, "mfu_pct": 2, "auc": 4, "ne": 4}
    print(f"\n| {source}, {layout} | " + " | ".join(MEASURES) + " |")
    print("|---|" + "---|" * len(MEASURES))
    for v, stats in row["stats"].items():
        print(f"| {v} | " + " | ".join(_cell(stats[m], digits[m]) for m in MEASURES) + " |")
    for v, against in row["vs_baseline"].items():
        print(f"| {v} / {BASELINE} | " + " | ".join(
            "-" if against["ratios"][m] is None else f"{against['ratios'][m]:.3f}" for m in MEASURES) + " |")
    for v, against in row["vs_baseline"].items():
        print(f"{v}: samples/s {'above' if against['faster'] else 'NOT above'} the baseline's, bubble fraction "
              f"{'lower' if against['fewer_bubbles'] else 'NOT lower'}; AUC {_quality_words(against, 'auc')} and NE "
              f"{_quality_words(against, 'ne')} the baseline's run-to-run spread", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", nargs="+", default=["synthetic", "ml100k"])
    parser.add_argument("--models", nargs="+", default=["transformer"], help="transformer, hstu")
    parser.add_argument("--layouts", nargs="+", default=["2", "4", "2x2"],
                        help="N: one job of N ranks; RxN: R replica groups of N ranks; Nh: N shaped hosts of one rank")
    parser.add_argument("--link-gbit", type=float, default=LINK_GBIT, help="the shaped hosts' link rate (Gbit/s)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=8, help="steps left out of the bubble report's means")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), metavar="NAME",
                        help=f"the variants to run (default: all of {', '.join(VARIANTS)}; {BASELINE} and {HEADLINE} "
                             "always run)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every run")
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "bench_e2e.json"))
    args = parser.parse_args()
    variants = [v for v in VARIANTS if v in {BASELINE, HEADLINE, *args.variants}]
    for layout in args.layouts:
        parts = layout.removesuffix("h").split("x")
        if not all(p.isdigit() and int(p) > 0 for p in parts) or len(parts) > 2 or (layout.endswith("h") and len(parts) > 1):
            raise SystemExit(f"--layouts: expected N, RxN or Nh, got '{layout}'")
        if layout.endswith("h") and not available()[0]:
            raise SystemExit(f"--layouts {layout}: {available()[1]}")

    common = common_overrides(args.steps, args.warmup, args.set)
    started = time.time()
    result = {"experiments": {e: os.path.relpath(p, REPO) for e, p in EXPERIMENTS.items()},
              "variants": {v: VARIANTS[v] for v in variants}, "steps": args.steps,
              "warmup_steps": args.warmup, "repeats": args.repeats, "overrides": args.set, "rows": []}
    report_dir = os.path.splitext(args.out)[0] + "_report"
    models = {m: section_overrides("models", m) for m in args.models}
    total = len(args.data) * len(models) * len(args.layouts) * args.repeats * len(variants)
    progress = bar(total=total, desc="bench_e2e", unit="run")
    with tempfile.TemporaryDirectory() as tmp:
        first_pair = None
        for source, (model, model_args) in ((s, m) for s in args.data for m in models.items()):
            overrides = [*section_overrides("data", source), *model_args]
            for layout in args.layouts:
                link = args.link_gbit if layout.endswith("h") else None
                runs = {v: [] for v in variants}
                for rep in range(args.repeats):
                    for v in variants:
                        experiment, extra = VARIANTS[v]
                        run_dir = os.path.join(tmp, f"{source}-{model}-{layout}-{v}-{rep}")
                        runs[v].append(run_once(experiment, layout, run_dir,
                                                [*overrides, *common, f"--run.seed={rep}", *extra], args.link_gbit))
                        progress.update()
                    # The repetition's runs trained the same global batches: the bytes of one are the others'.
                    add_bounds([runs[v][rep] for v in variants], link)
                    for v in variants:
                        r = runs[v][rep]
                        bound = "" if r["bound_ms"] is None else f" (bound {r['bound_ms']:.1f})"
                        say(progress, f"{source} {model} {layout:>4} rep {rep} {v:<15} "
                            f"{r['samples_per_s']:7.0f} samples/s | bubbles {r['bubble_fraction']:.3f} | straggler "
                            f"{r['straggler_pct']:5.1f}% | exposed comm {r['exposed_comm_ms']:5.1f} ms{bound} | MFU "
                            f"{r['mfu_pct']:.2f}% | auc {r['auc']:.4f} | ne {r['ne']:.4f} | {r['wall_s']:.0f} s")
                if first_pair is None:
                    first_pair = (runs[BASELINE][-1]["run_dir"], runs[HEADLINE][-1]["run_dir"], source, layout)
                row = {"data": source, "model": model, "layout": layout, **compare(runs), "runs": runs}
                if layout.endswith("h"):
                    row["link_gbit"] = args.link_gbit
                result["rows"].append(row)
                print_table(f"{source}, {model}", layout, row)
        if first_pair:
            shutil.rmtree(report_dir, ignore_errors=True)
            proc = subprocess.run([sys.executable, "-m", "freescale", "report", first_pair[0], first_pair[1], "--out",
                                   report_dir], cwd=REPO, capture_output=True, text=True)
            print(proc.stdout.strip() or proc.stderr.strip())
            result["report"] = {"dir": os.path.relpath(report_dir, REPO), "data": first_pair[2], "layout": first_pair[3]}
    for row in result["rows"]:
        for rs in row["runs"].values():
            for r in rs:
                r.pop("run_dir")
    result["all_hold"] = all(holds(r) for r in result["rows"])
    result["quality_within_spread_everywhere"] = all(all(r["vs_baseline"][HEADLINE]["quality_within_spread"].values())
                                                     for r in result["rows"])
    result["seconds"] = round(time.time() - started, 1)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_json_atomic(args.out, result)
    print(f"\nwrote {args.out} ({result['seconds']:.0f} s); FreeScale faster with fewer bubbles and AUC/NE no worse "
          f"than the baseline's spread on every row: {result['all_hold']} (within it everywhere: "
          f"{result['quality_within_spread_everywhere']})")


if __name__ == "__main__":
    main()
