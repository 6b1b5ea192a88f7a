"""The data path at scale: the Parquet reader against what training consumes, memory at two
dataset sizes 10x apart, and `freescale prepare` on a large event log.

    .venv/bin/python scripts/bench_data.py [--small N] [--factor 10] [--steps 120] [--repeats 3]
        [--reader-seconds 10] [--pass-stride 1] [--prepare-events N] [--work DIR] [--out PATH]

1. Two synthetic datasets of ``--small`` and ``factor x --small`` training samples with the
   quickstart experiment's settings (``freescale prepare --synthetic``, kept in ``--work`` and
   reused while their manifest matches), their size on disk.
2. Reader: rank 0 of 2 (``ParquetSource`` through the loader into batches) on one core, for
   ``--reader-seconds``, in samples/s, from the start and from the middle of the large set.
3. Training: the quickstart experiment on 2 CPU ranks (torchrun) for ``--steps`` steps on each
   dataset, with the read-ahead on (``data.read_ahead`` 2) and off (0), alternated and repeated:
   samples/s consumed (both ranks), the bubble report's data wait per step, and the peak RSS of
   the largest rank. Goals: the reader at least 5x what training consumes; the peak RSS at the two
   sizes the same within 10%.
4. A reader pass over one epoch of each dataset (every ``--pass-stride``-th global batch) in a
   process of its own: its peak RSS before and after, for both sizes.
5. ``freescale prepare`` on a synthetic event log: with ``--prepare-events N``,
   ``scripts/bench_prepare.py`` run on N events at its memory limits (events/s, peak RSS);
   without, the rows of its last run (docs/results/bench_prepare.json) are shown and kept.

Prints a table per part and writes every figure to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from freescale.data.measure import disk_bytes, reader_throughput, run_measured, spread  # noqa: E402
from freescale.data.prepare_bench import format_table  # noqa: E402
from freescale.io import write_json_atomic  # noqa: E402
from freescale.logging import quiet_known_warnings  # noqa: E402

QUICKSTART = os.path.join(REPO, "configs", "quickstart.yaml")


def synthetic_flags() -> list[str]:
    """``freescale prepare``'s flags for the quickstart experiment's samples."""
    with open(QUICKSTART) as f:
        data = yaml.safe_load(f)["data"]
    flags = [f"--max-uih-len={data['max_uih_len']}", f"--num-candidates={data['num_candidates']}"]
    return flags + [f"--synthetic.{k}={v}" for k, v in data["synthetic"].items()]


def make_dataset(folder: str, samples: int) -> dict:
    cmd = [sys.executable, "-m", "freescale", "prepare", "--synthetic", str(samples), "--out", folder, *synthetic_flags()]
    print(f"[bench_data] preparing {samples} synthetic samples into {folder}", file=sys.stderr, flush=True)
    proc, rss = run_measured(cmd, cwd=REPO)
    if proc.returncode:
        raise SystemExit(f"prepare failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return {"folder": folder, "samples": samples, "bytes": disk_bytes(folder)}


def train_once(folder: str, run_dir: str, steps: int, read_ahead: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "freescale",
           "train", "--config", QUICKSTART, f"--run.dir={run_dir}", "--data.source=parquet", f"--data.path={folder}",
           f"--data.read_ahead={read_ahead}", f"--train.steps={steps}", "--profile.enable=true",
           "--train.eval_every=0", "--checkpoint.every=0", "--checkpoint.at_end=false"]
    proc, rss = run_measured(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode:
        raise SystemExit(f"training failed (exit {proc.returncode}): {proc.stderr.strip()[-3000:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(run_dir, "config.yaml")) as f:
        batch = yaml.safe_load(f)["data"]["batch_size"]
    bubbles = summary["bubbles"]
    return {"samples_per_s": batch * 2 / (bubbles["step_ms"] / 1000.0), "data_wait_ms": bubbles["data_wait_ms_per_step"],
            "peak_rss_mib": rss}


def reader_pass_rss(folder: str, stride: int) -> dict:
    code = ("import json, sys; from freescale.data.measure import reader_pass; "
            f"print(json.dumps(reader_pass({folder!r}, batch_size=64, ranks=2, stride={stride})))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode:
        raise SystemExit(f"reader pass failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fmt(s: dict, digits: int = 0) -> str:
    return f"{s['mean']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", type=int, default=1_000_000, help="training samples of the smaller dataset")
    p.add_argument("--factor", type=int, default=10, help="the larger dataset is this many times the smaller")
    p.add_argument("--steps", type=int, default=120, help="training steps per run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--reader-seconds", type=float, default=10.0)
    p.add_argument("--pass-stride", type=int, default=1, help="reader pass: every this many global batches")
    p.add_argument("--prepare-events", type=int, default=0, help="also measure prepare on a log of this many events")
    p.add_argument("--work", default=os.path.join(REPO, "runs", "bench_data"))
    p.add_argument("--out", default=os.path.join(REPO, "docs", "results", "bench_data.json"))
    args = p.parse_args()
    quiet_known_warnings()  # (torch.fx's is_fx_tracing warning as the reader's modules load)
    os.makedirs(args.work, exist_ok=True)
    sizes = {"small": args.small, "large": args.small * args.factor}
    result: dict = {"command": " ".join(sys.argv), "datasets": {}, "reader": {}, "training": {}, "reader_pass": {}}

    for name, n in sizes.items():
        result["datasets"][name] = make_dataset(os.path.join(args.work, name), n)
    print(f"\n{'dataset':<8}{'samples':>12}{'on disk (MiB)':>16}")
    for name, d in result["datasets"].items():
        print(f"{name:<8}{d['samples']:>12}{d['bytes'] / 2**20:>16.1f}")

    large = result["datasets"]["large"]["folder"]
    middle = sizes["large"] // 2 // 128
    for where, start in (("start", 0), ("middle", middle)):
        runs = [reader_throughput(large, batch_size=64, ranks=2, seconds=args.reader_seconds, start_batch=start)
                ["samples_per_s"] for _ in range(args.repeats)]
        result["reader"][where] = spread(runs)

    runs: dict = {}
    for k in range(args.repeats):
        for name in sizes:
            for read_ahead in (2, 0):
                key = f"{name}/read_ahead={read_ahead}"
                print(f"[bench_data] training {key} (repeat {k + 1}/{args.repeats})", file=sys.stderr, flush=True)
                run_dir = os.path.join(args.work, "runs", f"{name}-ra{read_ahead}-{k}")
                runs.setdefault(key, []).append(train_once(result["datasets"][name]["folder"], run_dir, args.steps, read_ahead))
    for key, rs in runs.items():
        result["training"][key] = {m: spread([r[m] for r in rs]) for m in rs[0]}

    for name in sizes:
        result["reader_pass"][name] = reader_pass_rss(result["datasets"][name]["folder"], args.pass_stride)

    consumed = result["training"]["large/read_ahead=2"]["samples_per_s"]["mean"]
    reader = result["reader"]["start"]["mean"]
    rss_small = result["training"]["small/read_ahead=2"]["peak_rss_mib"]["mean"]
    rss_large = result["training"]["large/read_ahead=2"]["peak_rss_mib"]["mean"]
    result["ratios"] = {"reader_over_training": reader / consumed, "rss_large_over_small": rss_large / rss_small}

    print(f"\n{'reader (rank 0 of 2, 1 core)':<34}{'samples/s':>28}")
    for where, s in result["reader"].items():
        print(f"{'from the ' + where:<34}{fmt(s):>28}")
    print(f"\n{'training (2 ranks)':<26}{'samples/s':>24}{'data wait ms/step':>22}{'peak RSS MiB':>24}")
    for key, t in result["training"].items():
        print(f"{key:<26}{fmt(t['samples_per_s']):>24}{fmt(t['data_wait_ms'], 2):>22}{fmt(t['peak_rss_mib']):>24}")
    print(f"\n{'reader pass':<10}{'batches':>10}{'samples':>12}{'s':>8}{'RSS before MiB':>16}{'peak MiB':>10}")
    for name, r in result["reader_pass"].items():
        print(f"{name:<10}{r['batches']:>10}{r['samples']:>12}{r['seconds']:>8.1f}{r['rss_before_mib']:>16.0f}"
              f"{r['rss_peak_mib']:>10.0f}")
    print(f"\nreader / training consumption: {result['ratios']['reader_over_training']:.1f}x (goal >= 5x)")
    print(f"peak RSS large / small: {result['ratios']['rss_large_over_small']:.3f} (goal within 1 +- 0.10)")

    prepare_json = os.path.join(REPO, "docs", "results", "bench_prepare.json")
    if args.prepare_events:
        prepare_json = os.path.join(args.work, "bench_prepare.json")
        proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_prepare.py"), "--events",
                               str(args.prepare_events), "--json", prepare_json], cwd=REPO)
        if proc.returncode:
            raise SystemExit("bench_prepare failed")
    if os.path.isfile(prepare_json):  # (without --prepare-events: the last scripts/bench_prepare.py run)
        with open(prepare_json) as f:
            result["prepare"] = {"from": os.path.relpath(prepare_json, REPO), **json.load(f)}
        print(f"\nprepare ({result['prepare']['from']}):")
        print(format_table(result["prepare"]["rows"]))
    write_json_atomic(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
