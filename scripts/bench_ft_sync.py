"""Quality of training as several replica groups against one, for both kinds of tables.

    .venv/bin/python scripts/bench_ft_sync.py [--data ml100k|synthetic] [--replicas 2] [--steps 1000]
        [--repeats 5] [--sync-every 10] [--variants ...] [--set section.key=value ...] [--out PATH]

Trains ``configs/ft_local.yaml``'s model at its default learning rates four ways, with the same
global batch every step (``--replicas`` x ``data.batch_size`` samples) and the same samples:

- ``own_one_group`` / ``torchrec_one_group``: one group of ``--replicas`` ranks (FreeScale's own
  tables with ``train.pipeline: sync``, or TorchRec's with ``sparse_dist``): the reference;
- ``own_groups``: ``--replicas`` groups of one rank, FreeScale's tables; each step's row
  gradients are summed across the groups before the update (one synchronous job);
- ``torchrec_groups``: ``--replicas`` groups of one rank, TorchRec's tables; each group updates
  its own copy and every ``--sync-every`` steps the groups' changes are added up;
- ``torchrec_groups_average``: the same, the copies averaged at each sync instead (TorchRec
  ``DMPCollection``'s semantics: the anchor).

The groups run with ``ft.min_replicas`` equal to their number, so that no step trains with
fewer groups than the reference's ranks (a group that starts late would otherwise be caught up
over steps the others trained alone). Repetition k uses ``run.seed`` k (data and
initialization), which gives the spread; the variants alternate within each repetition.
Held-out AUC and normalized entropy over ``--eval-samples`` samples at the end.

``--data ml100k`` (the default) trains on MovieLens-100K (fetched once into ``runs/cache``, as
``configs/ml100k.yaml`` does; histories cut to 128 events), whose held-out AUC after 1000 steps
moves by about 0.005 between seeds. On the synthetic data of ``ft_local.yaml`` a run's AUC at a
given step depends on when it happens to pick up the clusters' structure: a last-bit
difference in the arithmetic moves it by as much as another seed does (0.61-0.83 at 3000
steps), which hides differences of 0.01.
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
from freescale.local import run_local  # noqa: E402

CONFIG = os.path.join(REPO, "configs", "ft_local.yaml")
DATA = {"ml100k": ["data.source=ml100k", "data.ratings.cache=runs/cache", "data.max_uih_len=128"], "synthetic": []}
VARIANTS = {  # name: (pipeline, several groups, ft.embedding_sync)
    "own_one_group": ("sync", False, "add"),
    "own_groups": ("sync", True, "add"),
    "torchrec_one_group": ("sparse_dist", False, "add"),
    "torchrec_groups": ("sparse_dist", True, "add"),
    "torchrec_groups_average": ("sparse_dist", True, "average"),
}


def train(name: str, args, overrides: list[str], root: str) -> dict:
    pipeline, groups, sync = VARIANTS[name]
    run_dir = os.path.join(root, f"{name}-{time.time_ns()}")
    replicas, nproc = (args.replicas, 1) if groups else (1, args.replicas)
    summary = run_local(CONFIG, [*overrides, f"train.pipeline={pipeline}", f"ft.min_replicas={replicas}",
                                 f"ft.embedding_sync_every={args.sync_every}", f"ft.embedding_sync={sync}",
                                 f"run.dir={run_dir}"],
                        replicas=replicas, nproc=nproc, out=io.StringIO(), progress_every_s=1e9)
    if not all(g["exit_code"] == 0 for g in summary["groups"]):
        raise RuntimeError(f"{name}: a group failed; see {run_dir}")
    with open(os.path.join(run_dir, "replica0", "summary.json")) as f:
        final = json.load(f)
    result = {"auc": final["eval/auc"], "ne": final["eval/ne"], "loss": final["eval/loss"]}
    print(f"  {name:<24} auc {result['auc']:.4f} | ne {result['ne']:.4f} | loss {result['loss']:.4f}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", choices=list(DATA), default="ml100k")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--eval-samples", type=int, default=4096)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every run")
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "bench_ft_sync.json"))
    args = parser.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    started = time.time()
    names = args.variants
    runs = {n: [] for n in names}
    progress = bar(total=args.repeats * len(names), desc="bench_ft_sync", unit="run")
    with tempfile.TemporaryDirectory(prefix="bench_ft_sync-") as root:
        for rep in range(args.repeats):
            say(progress, f"repetition {rep + 1}/{args.repeats} (run.seed {rep})")
            common = [*DATA[args.data], *args.set, f"train.steps={args.steps}", f"run.seed={rep}",
                      f"data.eval_samples={args.eval_samples}",
                      "train.eval_every=0", "train.ledger=false", "checkpoint.every=0", "checkpoint.at_end=false"]
            for name in (names if rep % 2 == 0 else names[::-1]):
                runs[name].append(train(name, args, common, root))
                progress.update()
    progress.close()
    stats = {n: {k: {"mean": round(statistics.fmean(r[k] for r in rs), 5), "min": min(r[k] for r in rs),
                     "max": max(r[k] for r in rs)} for k in ("auc", "ne")} for n, rs in runs.items()}
    # Per seed, the groups' AUC minus the one group's on the same data.
    pairs = {"own": ("own_one_group", "own_groups"), "torchrec": ("torchrec_one_group", "torchrec_groups"),
             "torchrec_average": ("torchrec_one_group", "torchrec_groups_average")}
    gaps = {kind: [g["auc"] - o["auc"] for o, g in zip(runs[one], runs[groups])]
            for kind, (one, groups) in pairs.items() if one in runs and groups in runs}
    print(f"\n{args.data}: {args.replicas} groups x 1 rank against 1 group x {args.replicas} ranks, {args.steps} steps, "
          f"{args.repeats} seeds, TorchRec tables synced every {args.sync_every} steps")
    print(f"{'variant':<25}{'AUC mean (min-max)':>26}{'NE mean (min-max)':>26}")
    for n in names:
        a, e = stats[n]["auc"], stats[n]["ne"]
        print(f"{n:<25}{a['mean']:>10.4f} ({a['min']:.4f}-{a['max']:.4f}){e['mean']:>10.4f} ({e['min']:.4f}-{e['max']:.4f})")
    for kind, values in gaps.items():
        print(f"{kind} tables: groups - one group, AUC per seed: {', '.join(f'{v:+.4f}' for v in values)}")
    write_json_atomic(args.out, {"args": vars(args), "runs": runs, "stats": stats,
                                 "auc_gap_per_seed": {k: [round(v, 5) for v in vs] for k, vs in gaps.items()},
                                 "seconds": round(time.time() - started, 1)})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
