"""Benchmark of serving exports: int8 and int4 tables against fp32, from one trained model.

    .venv/bin/python scripts/bench_serving.py [--run RUN_DIR] [--repeats 3] [--threads 1]
        [--batch-sizes 1 16 64 256] [--out docs/results/bench_serving.json]

Without ``--run`` the quickstart is trained as shipped (2 ranks, 1000 steps, no evaluation
during training) into a temporary folder. Its newest checkpoint is exported three times
(``freescale export --quantize fp32 / int8 / int4``); then ``serve-bench``'s measurement runs on
each export in this process, the quantizations taking turns, ``--repeats`` times. Prints, per
quantization: the files' size and its ratio to fp32, the held-out AUC and NE and their
difference to the fp32 export's (the same samples), and per batch size the latency p50 / p99
and queries/s (mean and range over the repeats) with the ratio of p50 to fp32's. Writes JSON.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from freescale.io import write_json_atomic  # noqa: E402
from freescale.logging import quiet_known_warnings  # noqa: E402
from freescale.progress import bar, say  # noqa: E402
from freescale.serve.bench import bench  # noqa: E402
from freescale.serve.export import export  # noqa: E402

QUANTIZATIONS = ["fp32", "int8", "int4"]


def train_quickstart(run_dir: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "freescale",
           "train", "--config", os.path.join(REPO, "configs", "quickstart.yaml"), "--train.eval_every=0",
           "--profile.enable=false", f"--run.dir={run_dir}"]
    print(f"training the quickstart into {run_dir} (about two minutes)", flush=True)
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"training failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def _stats(values: list[float]) -> dict:
    return {"mean": statistics.mean(values), "min": min(values), "max": max(values)}


def _cell(s: dict, digits: int = 2) -> str:
    return f"{s['mean']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def main() -> None:
    quiet_known_warnings()  # (torch.fx's is_fx_tracing warning at every export)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", default="", help="a trained run folder (default: train the quickstart)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads while serving (default 1)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "bench_serving.json"))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench_serving-") as tmp:
        run_dir = args.run or os.path.join(tmp, "quickstart")
        if not args.run:
            train_quickstart(run_dir)
        folders, manifests = {}, {}
        for q in bar(QUANTIZATIONS, desc="export", unit="export"):
            folders[q] = os.path.join(tmp, q)
            manifests[q] = export(run_dir, folders[q], quantize=q)
        runs = {q: [] for q in QUANTIZATIONS}
        progress = bar(total=args.repeats * len(QUANTIZATIONS), desc="serve-bench", unit="run")
        for rep in range(args.repeats):
            for q in (QUANTIZATIONS if rep % 2 == 0 else QUANTIZATIONS[::-1]):
                r = bench(folders[q], args.batch_sizes, threads=args.threads)
                runs[q].append(r)
                progress.update()
                say(progress, f"  rep {rep} {q}: " + ", ".join(
                    f"b{x['batch_size']} p50 {x['latency_ms_p50']:.2f} ms" for x in r["latency"]))
        progress.close()

    base = runs["fp32"][0]
    result = {"run": os.path.abspath(run_dir) if args.run else "quickstart (trained by this script)",
              "threads": args.threads, "repeats": args.repeats, "batch_sizes": args.batch_sizes,
              "heldout_samples": base["heldout_samples"], "trained_fp32": base["accuracy"]["trained_fp32"],
              "quantizations": {}}
    print(f"\nheld-out: {base['heldout_samples']} samples; trained model (fp32, training forward): AUC "
          f"{base['accuracy']['trained_fp32']['auc']:.4f}, NE {base['accuracy']['trained_fp32']['ne']:.4f}; "
          f"{args.threads} serving thread(s), {args.repeats} alternating repeats, mean (min-max)")
    print("| tables | size MiB | size / fp32 | AUC | AUC - fp32 | NE | NE - fp32 |\n|---|---|---|---|---|---|---|")
    ref = runs["fp32"][0]["accuracy"]["exported"]
    for q in QUANTIZATIONS:
        r0 = runs[q][0]
        acc = r0["accuracy"]["exported"]
        entry = {"size_bytes": r0["size_bytes"], "files": r0["files"],
                 "size_ratio_to_fp32": r0["size_bytes"] / base["size_bytes"], "auc": acc["auc"], "ne": acc["ne"],
                 "auc_minus_fp32": acc["auc"] - ref["auc"], "ne_minus_fp32": acc["ne"] - ref["ne"],
                 "latency": {}, "runs": runs[q]}
        print(f"| {q} | {r0['size_bytes'] / 2**20:.2f} | {entry['size_ratio_to_fp32']:.3f} | {acc['auc']:.4f} | "
              f"{entry['auc_minus_fp32']:+.4f} | {acc['ne']:.4f} | {entry['ne_minus_fp32']:+.4f} |")
        for i, size in enumerate(args.batch_sizes):
            rows = [r["latency"][i] for r in runs[q]]
            entry["latency"][size] = {k: _stats([x[k] for x in rows])
                                      for k in ("latency_ms_p50", "latency_ms_p99", "queries_per_s")}
        result["quantizations"][q] = entry
    print("\n| batch size | tables | latency p50 ms | latency p99 ms | queries/s | p50 / fp32's |\n|---|---|---|---|---|---|")
    for size in args.batch_sizes:
        fp = result["quantizations"]["fp32"]["latency"][size]["latency_ms_p50"]["mean"]
        for q in QUANTIZATIONS:
            cell = result["quantizations"][q]["latency"][size]
            cell["p50_ratio_to_fp32"] = cell["latency_ms_p50"]["mean"] / fp
            print(f"| {size} | {q} | {_cell(cell['latency_ms_p50'], 3)} | {_cell(cell['latency_ms_p99'], 3)} | "
                  f"{_cell(cell['queries_per_s'], 1)} | {cell['p50_ratio_to_fp32']:.2f}x |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_json_atomic(args.out, result)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
