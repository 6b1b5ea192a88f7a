"""Retrieval quality: FreeScale's HSTU against RecBole's SASRec on MovieLens-100K.

    .venv/bin/python scripts/bench_quality.py --seeds 0 1 2 [--out docs/results/bench_quality.json]
        [--only sasrec|hstu] [--reuse-sasrec PATH] [--sasrec-epochs 8]

Per seed: (a) RecBole 1.2.1's SASRec through ``scripts/recbole_sasrec.py``, run with the python
of a separate virtual environment (``runs/cache/recbole-venv``, created once, pinned below;
RecBole is never a FreeScale dependency); (b) ``<this python> -m freescale train --config
configs/hstu_ml100k.yaml --run.seed=S --run.out_dir=<tmp>``, whose ``summary.json`` must hold
``eval/hr@10``, ``eval/ndcg@10``, ``eval/mrr``, ``eval/mrr@10`` and ``train_s`` (wall seconds of
training only; ``wall_s``, the whole run, is taken and marked as such when it is missing).
Prints per-seed figures, mean and min..max per model, and HSTU/SASRec for HR@10 and NDCG@10;
writes the JSON atomically (versions, settings, per-seed figures, command line).
``--reuse-sasrec`` takes SASRec's per-seed figures from an earlier JSON of this script.

Protocol, the same on both sides:
- data: ``ml-100k.inter`` of the recbole==1.2.1 wheel (943 users, 1682 items, 100K ratings; no
  user rates an item twice), the same file ``freescale/data/ml100k.py`` extracts (checked by hash).
- leave-one-out by time: each user's interactions sorted by timestamp, ties kept in file order
  (RecBole's ``order: TO`` is a stable sort); the last one is the test target, the ones before
  it are the history the model reads (the last ``max_len``).
- full ranking of the target against all 1682 items, the user's other interacted items excluded.
  RecBole's full-sort evaluation does not do that for sequential models (its
  ``FullSortEvalDataLoader`` gives no history index when the model is sequential, so only the
  padding item is masked); the driver ranks ``full_sort_predict``'s scores itself with the
  history masked, and also reports the unmasked figures, checked equal to RecBole's own.
- metrics from the target's 0-based rank r: HR@10, NDCG@10, MRR (over the whole ranking) and
  MRR@10 (RecBole's MRR, cut at 10), averaged over the 943 users.
- shared settings: embedding size 64, max sequence length 20, 3 seeds. RecBole's default length
  50 costs about 5-10 minutes an epoch on this 2-core shared box (measured), so 20 is used on
  both sides.
- training time: wall seconds of training only (no data loading, no evaluation).

SASRec keeps RecBole's defaults (2 layers, 2 heads, inner 256, dropout 0.5, CE loss over all
items, Adam lr 1e-3, batch 2048) except: the split and order above, ``MAX_ITEM_LIST_LENGTH`` 20,
``train_neg_sample_args: None`` (RecBole requires it with the CE loss), a fixed epoch count with
no early stopping (``stopping_step`` = epochs) and the final model evaluated.

Validation split: SASRec runs with ``LS: valid_and_test``, so each user's second-to-last item is
held out of its training targets and scored on every epoch: that curve is the convergence check,
recorded per seed. It is never used to select the model (the final epoch is tested), and the test
input still contains that item, so the only difference from FreeScale (which trains on everything
but the last item) is about 1% fewer training targets for SASRec (97,171 vs 98,114), against the
peer. ``--sasrec-split test_only`` trains SASRec on exactly FreeScale's data (no curve).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from freescale.io import write_json_atomic  # noqa: E402

MODELS = ("sasrec", "hstu")
METRICS = ("hr@10", "ndcg@10", "mrr", "mrr@10")
RATIO_METRICS = ("hr@10", "ndcg@10")
HSTU_CONFIG = "configs/hstu_ml100k.yaml"
HSTU_SUMMARY_KEYS = {m: f"eval/{m}" for m in METRICS}
RECBOLE_VENV = os.path.join(REPO, "runs", "cache", "recbole-venv")
RECBOLE_DRIVER = os.path.join(REPO, "scripts", "recbole_sasrec.py")
# RecBole 1.2.1 sets np.float_ and friends at import (gone in numpy 2) and its quick_start imports
# ray, which nothing here uses: it is installed without its declared dependencies, these instead.
RECBOLE_PINS = ["recbole==1.2.1", "torch==2.13.0", "numpy==1.26.4", "pandas==2.2.3", "scipy==1.13.1",
                "scikit-learn==1.5.2", "tensorboard", "colorlog==4.7.2", "colorama==0.4.4", "pyyaml", "tqdm",
                "texttable", "tabulate", "thop", "psutil"]
SETTINGS = {"embedding_dim": 64, "max_len": 20, "sasrec_batch_size": 256}
"""Shared: embedding size and history length. SASRec's batch (RecBole's default is 2048): 256
gives it 8x the optimizer steps per epoch, so that it converges in the epochs this machine can
afford; its validation curve in the JSON shows where it levelled off."""


class UsageError(Exception):
    """A bad command line: one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def parse_args(argv=None) -> argparse.Namespace:
    p = _Parser(prog="bench_quality.py", description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds, one run of each model per seed")
    p.add_argument("--out", default="docs/results/bench_quality.json", help="JSON results file")
    p.add_argument("--only", choices=MODELS, help="run one model only")
    p.add_argument("--reuse-sasrec", metavar="PATH", help="take SASRec's figures from an earlier JSON of this script")
    p.add_argument("--sasrec-epochs", type=int, default=8, help="SASRec's training epochs (fixed; default 8)")
    p.add_argument("--sasrec-split", choices=["valid_and_test", "test_only"], default="valid_and_test",
                   help="RecBole's leave-one-out mode for SASRec (see the protocol)")
    p.add_argument("--note", default="", help="free text kept in the JSON (how the runs were made, the machine's load)")
    args = p.parse_args(argv)
    if any(s < 0 for s in args.seeds):
        raise UsageError(f"--seeds: seeds must be >= 0, got {args.seeds}")
    if len(set(args.seeds)) != len(args.seeds):
        raise UsageError(f"--seeds: each seed once, got {args.seeds}")
    if args.sasrec_epochs < 1:
        raise UsageError(f"--sasrec-epochs: expected >= 1, got {args.sasrec_epochs}")
    if args.reuse_sasrec:
        if args.only == "sasrec":
            raise UsageError("--reuse-sasrec with --only sasrec: nothing would run")
        args.reused = load_reused_sasrec(args.reuse_sasrec, args.seeds)
    if args.only != "sasrec" and not os.path.exists(os.path.join(REPO, HSTU_CONFIG)):
        raise UsageError(f"{HSTU_CONFIG} (FreeScale's HSTU retrieval config) does not exist; --only sasrec runs the peer alone")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        raise UsageError(f"--out: folder {os.path.dirname(os.path.abspath(args.out))} does not exist")
    return args


def load_reused_sasrec(path: str, seeds: list[int]) -> dict:
    """SASRec's per-seed entries of an earlier result file, for the seeds asked for."""
    try:
        with open(path) as f:
            earlier = json.load(f)
    except OSError as e:
        raise UsageError(f"--reuse-sasrec: cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"--reuse-sasrec: {path} is not JSON ({e.msg} at line {e.lineno})") from None
    runs = earlier.get("runs", {}).get("sasrec", {}) if isinstance(earlier, dict) else {}
    missing = [s for s in seeds if str(s) not in runs]
    if missing:
        raise UsageError(f"--reuse-sasrec: {path} has no SASRec run for seed(s) {missing}")
    if earlier.get("settings", {}).get("shared") != SETTINGS:
        raise UsageError(f"--reuse-sasrec: {path} was run with {earlier.get('settings', {}).get('shared')}, "
                         f"not {SETTINGS}")
    return {"path": path, "runs": {str(s): runs[str(s)] for s in seeds}, "settings": earlier["settings"]}


# ---------------------------------------------------------------- figures, table, ratio (pure)

def spread(values: list[float]) -> dict:
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}


def converged(valid_mrr: list[float], tolerance: float = 0.02) -> bool | None:
    """Whether a validation curve has flattened: its last epoch gained under ``tolerance``
    (relative) on the best epoch before it. None without at least two points."""
    if len(valid_mrr) < 2:
        return None
    return valid_mrr[-1] < max(valid_mrr[:-1]) * (1 + tolerance)


def summarize(runs: dict) -> dict:
    """Per model: mean and min..max of each metric and of the training time over its seeds; and
    HSTU/SASRec of the means for HR@10 and NDCG@10 when both models ran."""
    summary = {}
    for model, per_seed in runs.items():
        if not per_seed:
            continue
        figures = list(per_seed.values())
        summary[model] = {m: spread([r["metrics"][m] for r in figures]) for m in METRICS}
        summary[model]["train_s"] = spread([r["train_s"] for r in figures])
        if all("epoch_s" in r for r in figures):
            summary[model]["epoch_s"] = spread([s for r in figures for s in r["epoch_s"]])
    if "sasrec" in summary and "hstu" in summary:
        summary["ratio_hstu_over_sasrec"] = {m: summary["hstu"][m]["mean"] / summary["sasrec"][m]["mean"]
                                             for m in RATIO_METRICS}
    return summary


def format_table(runs: dict, summary: dict) -> str:
    head = f"{'model':<8}{'seed':>14}" + "".join(f"{m:>24}" for m in METRICS) + f"{'train s':>24}"
    lines = [head, "-" * len(head)]
    for model, per_seed in runs.items():
        for seed, r in sorted(per_seed.items(), key=lambda kv: int(kv[0])):
            lines.append(f"{model:<8}{seed:>14}" + "".join(f"{r['metrics'][m]:>24.4f}" for m in METRICS)
                         + f"{r['train_s']:>24.1f}")
        if model in summary:
            s = summary[model]
            cell = lambda x, f: f"{x['mean']:{f}} ({x['min']:{f}}..{x['max']:{f}})"  # noqa: E731
            lines.append(f"{model:<8}{'mean (range)':>14}" + "".join(f"{cell(s[m], '.4f'):>24}" for m in METRICS)
                         + f"{cell(s['train_s'], '.1f'):>24}")
    for model, per_seed in runs.items():
        for seed, r in sorted(per_seed.items(), key=lambda kv: int(kv[0])):
            if r.get("valid_mrr@10"):
                flat = converged(r["valid_mrr@10"])
                lines.append(f"{model} seed {seed} validation MRR@10 by epoch: "
                             + " ".join(f"{v:.4f}" for v in r["valid_mrr@10"])
                             + ("  (flat: converged)" if flat else "  (still rising: NOT converged)"))
        if "epoch_s" in summary.get(model, {}):
            e = summary[model]["epoch_s"]
            lines.append(f"{model} seconds per epoch: {e['mean']:.1f} ({e['min']:.1f}..{e['max']:.1f})")
    if "ratio_hstu_over_sasrec" in summary:
        lines.append("HSTU/SASRec (means): " + ", ".join(f"{m} {v:.3f}x"
                                                         for m, v in summary["ratio_hstu_over_sasrec"].items()))
    return "\n".join(lines)


def result_document(args, runs: dict, settings: dict, versions: dict, argv: list[str]) -> dict:
    summary = summarize(runs)
    return {"command": " ".join(argv), "note": args.note, "seeds": args.seeds, "settings": settings,
            "versions": versions, "machine": {"cpus": os.cpu_count(), "load_average_at_end": os.getloadavg()},
            "runs": runs, "summary": summary}


# ---------------------------------------------------------------- running the two sides

def say(message: str) -> None:
    print(f"[bench_quality] {message}", file=sys.stderr, flush=True)


def ensure_recbole_venv(venv: str = RECBOLE_VENV) -> str:
    """The python of RecBole's own virtual environment, created and filled once (a stamp names the pins)."""
    python = os.path.join(venv, "bin", "python")
    stamp = os.path.join(venv, ".bench-quality-stamp")
    if os.path.exists(stamp) and open(stamp).read() == " ".join(RECBOLE_PINS):
        return python
    say(f"creating RecBole's virtual environment {venv} (once)")
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    say("installing recbole==1.2.1 (without its declared ray/plotly dependencies)")
    subprocess.run([python, "-m", "pip", "install", "--no-deps", RECBOLE_PINS[0]], check=True)
    say("installing " + " ".join(RECBOLE_PINS[1:]) + " (a few minutes)")
    subprocess.run([python, "-m", "pip", "install", *RECBOLE_PINS[1:]], check=True)
    with open(stamp, "w") as f:
        f.write(" ".join(RECBOLE_PINS))
    return python


def run_sasrec(python: str, seed: int, epochs: int, split: str, work: str) -> dict:
    """One SASRec seed through the driver; a finished seed with the same settings is not rerun."""
    out = os.path.join(work, f"sasrec-len{SETTINGS['max_len']}-b{SETTINGS['sasrec_batch_size']}-ep{epochs}-{split}"
                             f"-seed{seed}.json")
    if not os.path.exists(out):
        say(f"SASRec seed {seed}: {epochs} epochs (RecBole, {os.path.relpath(python, REPO)})")
        cmd = [python, "-W", "ignore", RECBOLE_DRIVER, "--seed", str(seed), "--epochs", str(epochs),
               "--max-len", str(SETTINGS["max_len"]), "--embedding-dim", str(SETTINGS["embedding_dim"]),
               "--batch-size", str(SETTINGS["sasrec_batch_size"]), "--split", split, "--work-dir", os.path.join(work, "recbole"), "--out", out]
        if subprocess.run(cmd).returncode != 0:
            raise RuntimeError(f"SASRec seed {seed} failed: {' '.join(cmd)}")
    with open(out) as f:
        driver = json.load(f)
    for point in driver["valid_curve"]:
        say(f"SASRec seed {seed} validation after epoch {point['epoch']}: "
            + " ".join(f"{k} {v:.4f}" for k, v in point.items() if k != "epoch"))
    return {"metrics": driver["metrics"], "train_s": driver["train_seconds"],
            "epoch_s": [round(e["seconds"], 2) for e in driver["epochs"]],
            "valid_mrr@10": [round(p["mrr@10"], 4) for p in driver["valid_curve"]],
            "converged": converged([p["mrr@10"] for p in driver["valid_curve"]]), "driver": driver}


def hstu_command(seed: int, out_dir: str) -> list[str]:
    return [sys.executable, "-m", "freescale", "train", "--config", HSTU_CONFIG, f"--run.seed={seed}",
            f"--run.out_dir={out_dir}"]


def read_hstu_summary(out_dir: str, seed: int) -> dict:
    """The figures of the one run folder under ``out_dir``, from its summary.json."""
    found = glob.glob(os.path.join(out_dir, "*", "summary.json"))
    if len(found) != 1:
        raise RuntimeError(f"HSTU seed {seed}: expected one summary.json under {out_dir}, found {len(found)}")
    with open(found[0]) as f:
        summary = json.load(f)
    missing = [k for k in HSTU_SUMMARY_KEYS.values() if k not in summary]
    if missing:
        raise RuntimeError(f"HSTU seed {seed}: {found[0]} lacks {missing}")
    time_key = "train_s" if "train_s" in summary else "wall_s"
    return {"metrics": {m: float(summary[k]) for m, k in HSTU_SUMMARY_KEYS.items()},
            "train_s": float(summary[time_key]), "train_s_source": time_key, "summary": summary}


def run_hstu(seed: int) -> dict:
    """One FreeScale HSTU seed: ``freescale train`` into a fresh folder, then its summary.json."""
    with tempfile.TemporaryDirectory(prefix="bench_quality-") as out_dir:
        cmd = hstu_command(seed, out_dir)
        say(f"HSTU seed {seed}: {' '.join(cmd[1:])}")
        if subprocess.run(cmd, cwd=REPO).returncode != 0:
            raise RuntimeError(f"HSTU seed {seed} failed: {' '.join(cmd)}")
        return read_hstu_summary(out_dir, seed)


def versions(recbole_driver_versions: dict | None) -> dict:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        out["freescale_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                                 text=True).stdout.strip()
    except OSError:
        pass
    if recbole_driver_versions:
        out["recbole_env"] = recbole_driver_versions
    return out


def check_same_data(driver: dict) -> None:
    from freescale.data.ml100k import ensure_ml100k

    with open(ensure_ml100k(os.path.join(REPO, "runs", "cache")), "rb") as f:
        ours = hashlib.sha256(f.read()).hexdigest()
    if ours != driver["data"]["sha256"]:
        raise RuntimeError(f"RecBole read {driver['data']['path']}, which differs from FreeScale's ml-100k.inter")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)
    except UsageError as e:
        print(f"bench_quality.py: error: {e}", file=sys.stderr)
        return 2
    settings = {"shared": SETTINGS, "protocol": {
        "split": "leave-one-out by time (stable sort, ties in file order); last interaction = test target",
        "ranking": "full, all items; the user's other interacted items excluded (RecBole's full-sort evaluation "
                   "masks no history for sequential models, so the driver masks it; RecBole's unmasked figures "
                   "are kept beside)",
        "metrics": "HR@10, NDCG@10, MRR (full), MRR@10 from the target's 0-based rank"},
        "sasrec": {"epochs": args.sasrec_epochs, "split": args.sasrec_split,
                   "validation": "valid_and_test: second-to-last item scored every epoch (convergence check), "
                                 "never used for model selection; final epoch tested" if args.sasrec_split ==
                                 "valid_and_test" else "none: trained on everything but the last item"},
        "hstu": {"config": HSTU_CONFIG, "summary_keys": HSTU_SUMMARY_KEYS,
                 "time_key": "train_s (wall seconds of training only; wall_s is taken, and marked, without it)"}}
    runs = {"sasrec": {}, "hstu": {}}
    work = os.path.join(REPO, "runs", "quality")
    os.makedirs(work, exist_ok=True)
    driver_versions = None
    try:
        if getattr(args, "reused", None):
            runs["sasrec"] = args.reused["runs"]
            settings["sasrec"] = {**args.reused["settings"]["sasrec"], "reused_from": args.reused["path"]}
            driver_versions = next(iter(runs["sasrec"].values()))["driver"]["versions"]
        elif args.only != "hstu":
            python = ensure_recbole_venv()
            for seed in args.seeds:
                runs["sasrec"][str(seed)] = run_sasrec(python, seed, args.sasrec_epochs, args.sasrec_split, work)
                check_same_data(runs["sasrec"][str(seed)]["driver"])
                r = runs["sasrec"][str(seed)]
                say(f"SASRec seed {seed}: " + " ".join(f"{m} {r['metrics'][m]:.4f}" for m in METRICS)
                    + f", train {r['train_s']:.1f}s")
            driver_versions = runs["sasrec"][str(args.seeds[0])]["driver"]["versions"]
        if args.only != "sasrec":
            for seed in args.seeds:
                runs["hstu"][str(seed)] = run_hstu(seed)
    except (RuntimeError, subprocess.CalledProcessError) as e:
        print(f"bench_quality.py: {e}", file=sys.stderr)
        return 1
    runs = {m: r for m, r in runs.items() if r}
    doc = result_document(args, runs, settings, versions(driver_versions),
                          [os.path.relpath(sys.executable, REPO), "scripts/bench_quality.py", *argv])
    print(format_table(runs, doc["summary"]))
    write_json_atomic(args.out, doc)
    say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
