"""Time HSTU's dense training step (forward+backward of the task alone) on real batches.

For each config (``configs/hstu_ml100k.yaml``: retrieval on MovieLens-100K, histories up to
20; ``configs/hstu_ranking.yaml``: ranking on heavy-tailed synthetic histories up to 512) the
task is built as the trainer builds it (``build_task`` with the run's settings, seed fixed),
its batches are the train source's first ``--batches`` local batches (``build_sources``,
``Batch.from_samples``) and the rows come from an ``nn.Embedding`` (the sparse part is not
timed). A step is: rows looked up, the task's loss, ``backward``.

``--baseline REV`` also times the code of git revision ``REV`` (exported to a temporary tree)
in the same run: each round runs every variant once, in a fresh process each, alternating,
so the shared cores' noise falls on both; the table gives the range of the per-round medians
and the ratio to the baseline within each round. Keys of a config that ``REV``'s code refuses
as unknown (options added since) are left out of the config for both variants, so that both
time the same work; the script names them and the JSON keeps them (``left_out_for_both``).
MFU is against ``freescale.profile.peak``'s measured matmul peak for the config's widths; MFLOP/sample counts forward+backward
(``freescale.model.flops.training_flops``).

    .venv/bin/python scripts/bench_hstu_step.py --repeats 3 --baseline <rev>
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ("configs/hstu_ml100k.yaml", "configs/hstu_ranking.yaml")


def measure(config: str, batches: int, iters: int, seed: int, threads: int) -> dict:
    """Per-step times (ms, the best of ``iters`` passes per batch: the least disturbed by the other
    work on shared cores) of one config, in this process."""
    import numpy as np
    import torch
    import torch.nn as nn

    from freescale.config import load_config
    from freescale.data.batch import Batch
    from freescale.data.loader import build_sources
    from freescale.model.flops import matmul_widths, training_flops
    from freescale.model.seqrec import build_task, task_arguments, task_settings
    from freescale.profile.peak import matmul_peak

    if threads:
        torch.set_num_threads(threads)
    cfg = load_config(os.path.join(ROOT, config), [f"data.ratings.cache={os.path.join(ROOT, 'runs/cache')}"])
    source, _ = build_sources(cfg.data, cfg.run.seed, task=cfg.task)
    size = cfg.data.batch_size
    data = [Batch.from_samples(source.samples_at(np.arange(i * size, (i + 1) * size, dtype=np.int64)), i,
                               cfg.model.user_hash_size) for i in range(batches)]
    torch.manual_seed(seed)
    task = build_task(cfg.model, **task_settings(cfg)).train()
    # Sparse gradients: the tables' own update is the sparse part's work, not the dense step's.
    items = nn.Embedding(source.num_items + 1, cfg.model.embedding_dim, sparse=True)
    users = (nn.Embedding(cfg.model.user_hash_size, cfg.model.embedding_dim, sparse=True) if cfg.model.user_features
             else None)

    def step(batch: Batch) -> None:
        torch.manual_seed(seed)  # the same dropout masks every pass
        rows = items(batch.item_ids)
        n_uih = int(batch.uih_lengths.sum())
        user = users(batch.user_features.values()) if users is not None else None
        loss, _ = task(rows[:n_uih], rows[n_uih:], user, *task_arguments(batch))
        loss.backward()
        task.zero_grad(set_to_none=True)
        items.zero_grad(set_to_none=True)

    for batch in data:  # warm-up
        step(batch)
    ms = []
    for batch in data:
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            step(batch)
            times.append((time.perf_counter() - start) * 1e3)
        ms.append(min(times))
    flops = [training_flops(task, b.uih_lengths, b.cand_counts) for b in data]
    samples = [len(b) for b in data]
    peak = matmul_peak(torch.device("cpu"), matmul_widths(cfg.model), cfg.profile.peak_cache)
    return {"ms_per_batch": ms, "samples": samples, "flops": flops, "peak_flop_per_s": peak.flop_per_s,
            "tokens": [int(b.uih_lengths.sum() + (b.cand_counts.sum() if cfg.task.kind == "ranking" else 0))
                       for b in data], "threads": torch.get_num_threads(), "torch": torch.__version__}


def worker(tree: str, args, *extra: str) -> dict:
    """This script's worker mode run on the code under ``tree``, in a fresh process: its JSON line.
    A worker that fails stops the benchmark with its last line of stderr (exit 2)."""
    command = [sys.executable, os.path.abspath(__file__), "--worker", "--batches", str(args.batches),
               "--iters", str(args.iters), "--seed", str(args.seed), "--threads", str(args.threads),
               "--configs", ",".join(args.configs), *extra]
    env = {**os.environ, "PYTHONPATH": tree}
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["(no output)"]
        print(f"bench_hstu_step: the worker on {tree} failed: {lines[-1]}", file=sys.stderr)
        sys.exit(2)
    return json.loads(done.stdout.strip().splitlines()[-1])


def drop(data: dict, key: str) -> None:
    """Delete the dotted ``key`` (``section.name``) from a config's YAML mapping."""
    *parents, leaf = key.split(".")
    for part in parents:
        data = data[part]
    del data[leaf]


def unknown_keys(config: str) -> list[str]:
    """The dotted keys of ``config`` that the code imported here refuses as unknown (found by loading
    it and leaving out each key its error names, as a revision older than the config would)."""
    import re

    import yaml

    from freescale.config import ConfigError, load_config

    with open(os.path.join(ROOT, config)) as f:
        data = yaml.safe_load(f)
    dropped = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.yaml")
        while True:
            with open(path, "w") as f:
                yaml.safe_dump(data, f)
            try:
                load_config(path)
                return dropped
            except ConfigError as e:
                found = re.search(r"unknown config key '([^']+)'", str(e))
                if not found:
                    raise
                key = found.group(1)
                drop(data, key)
                dropped.append(key)


def common_configs(base: str, tmp: str, args) -> dict:
    """Point ``args.configs`` at copies of the configs without the keys the baseline does not know,
    so that both variants time the same work; returns {config: keys left out}."""
    import yaml

    left_out = worker(base, args, "--probe")
    if not any(left_out.values()):
        return left_out
    common = []
    for config in args.configs:
        with open(os.path.join(ROOT, config)) as f:
            data = yaml.safe_load(f)
        for key in left_out[config]:
            drop(data, key)
        path = os.path.join(tmp, "common-" + os.path.basename(config))
        with open(path, "w") as f:
            yaml.safe_dump(data, f)
        common.append(path)
        if left_out[config]:
            print(f"{config}: left out for both variants (unknown to {args.baseline}): {', '.join(left_out[config])}")
    args.configs = common
    return left_out


def summary(result: dict) -> dict:
    ms = sum(result["ms_per_batch"]) / len(result["ms_per_batch"])  # per step, over the batches
    samples = sum(result["samples"]) / len(result["samples"])
    flops = sum(result["flops"]) / len(result["flops"])
    return {"ms_per_step": ms, "samples_per_s": samples / ms * 1e3, "mflop_per_sample": flops / samples / 1e6,
            "mfu_pct": 100.0 * flops / (ms / 1e3) / result["peak_flop_per_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each runs every variant once")
    parser.add_argument("--batches", type=int, default=4, help="batches per config (the first of the train split)")
    parser.add_argument("--iters", type=int, default=3, help="timed passes per batch (their median counts)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, as training)")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--baseline", default="", help="a git revision to time in the same run")
    parser.add_argument("--out", default="docs/results/bench_hstu_step.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.configs = args.configs.split(",")
    if args.worker and args.probe:
        print(json.dumps({c: unknown_keys(c) for c in args.configs}))
        return
    if args.worker:
        print(json.dumps({c: measure(c, args.batches, args.iters, args.seed, args.threads) for c in args.configs}))
        return

    from freescale.io import write_json_atomic

    with tempfile.TemporaryDirectory() as tmp:
        trees = {"current": ROOT}
        if args.baseline:
            base = os.path.join(tmp, "baseline")
            os.makedirs(base)
            archive = subprocess.run(["git", "-C", ROOT, "archive", args.baseline, "freescale"], check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", base], input=archive, check=True)
            for name in ("configs", "runs"):  # the configs and data cache of this tree
                os.symlink(os.path.join(ROOT, name), os.path.join(base, name))
            trees = {"baseline": base, **trees}
            names = list(args.configs)
            left_out = common_configs(base, tmp, args)
        else:
            names, left_out = list(args.configs), {}
        rounds = {v: [] for v in trees}
        for r in range(args.repeats):
            for variant, tree in trees.items():
                rounds[variant].append(worker(tree, args))  # one round of every config
                print(f"round {r + 1}/{args.repeats} {variant}: " + ", ".join(
                    f"{os.path.basename(c)} {summary(rounds[variant][-1][c])['ms_per_step']:.1f} ms"
                    for c in args.configs), flush=True)
        # Results under the configs' own names, not the temporary copies'.
        rounds = {v: [{name: rd[path] for name, path in zip(names, args.configs)} for rd in rs]
                  for v, rs in rounds.items()}
        args.configs = names

    table = {}
    print(f"\n{'config':<18} {'variant':<9} {'ms/step':>17} {'samples/s':>17} {'MFLOP/sample':>13} "
          f"{'MFU %':>13} {'vs baseline':>13}")
    for config in args.configs:
        for variant in trees:
            per_round = [summary(rd[config]) for rd in rounds[variant]]
            entry = {k: [s[k] for s in per_round] for k in per_round[0]}
            if "baseline" in trees:
                entry["speedup_vs_baseline"] = [summary(b[config])["ms_per_step"] / s["ms_per_step"]
                                                for b, s in zip(rounds["baseline"], per_round)]
            table.setdefault(config, {})[variant] = entry

            def span(key, fmt):
                return f"{fmt.format(min(entry[key]))}-{fmt.format(max(entry[key]))}"
            speed = span("speedup_vs_baseline", "{:.2f}") + "x" if "speedup_vs_baseline" in entry else "-"
            print(f"{os.path.basename(config):<18} {variant:<9} {span('ms_per_step', '{:.1f}'):>17} "
                  f"{span('samples_per_s', '{:.0f}'):>17} {entry['mflop_per_sample'][0]:>13.2f} "
                  f"{span('mfu_pct', '{:.2f}'):>13} {speed:>13}")
    write_json_atomic(os.path.join(ROOT, args.out), {
        "command": " ".join(["scripts/bench_hstu_step.py", *sys.argv[1:]]),
        "baseline": args.baseline, "left_out_for_both": left_out, "settings": {k: getattr(args, k) for k in ("repeats", "batches", "iters", "seed", "threads")},
        "results": table, "rounds": rounds,
    })


if __name__ == "__main__":
    main()
