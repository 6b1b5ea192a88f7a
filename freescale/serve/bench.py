"""``freescale serve-bench``: an export's latency, throughput, accuracy and size.

The model is loaded by the export's own ``serve.py`` (what a serving process runs). For each
batch size the run's held-out samples (regenerated from the export's ``config.yaml``) are cut
into batches of that size and each batch is one request: after a warm-up, every request's
latency is timed (p50, p99) and queries/s counts samples (a query is one sample and its
candidates) over the time spent in requests. The exported model's held-out figures over the
same samples are set against the trained fp32 model's, which the export recorded: each label's
AUC and NE (ranking), or HR@K, NDCG@K and MRR of the held-out users' next items ranked against
the whole table (retrieval: the export's queries against its item vectors, ranked by the same
``target_ranks`` as training's evaluation). A retrieval request asks for each user's top 10.
"""

from __future__ import annotations

import importlib.util
import os
import time
from typing import NamedTuple

import numpy as np
import torch

from freescale.config import load_config
from freescale.progress import bar
from freescale.serve.checks import check_bench, check_export_folder
from freescale.serve.export import held_out, heldout_metrics

WARMUP = 3  # requests before timing (allocator, first calls into fbgemm)
TOP_K = 10  # items a retrieval request asks for


def load_export(folder: str):
    """The export in ``folder``, loaded by its own ``serve.py``."""
    check_export_folder(folder)
    path = os.path.join(folder, "serve.py")
    spec = importlib.util.spec_from_file_location(f"freescale_export_{abs(hash(folder))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.load(folder)


class Request(NamedTuple):
    """One request of held-out samples, jagged as ``serve.py`` takes them, with their labels."""

    uih_ids: torch.Tensor
    uih_lengths: torch.Tensor
    cand_ids: torch.Tensor
    cand_counts: torch.Tensor
    user_ids: torch.Tensor
    uih_timestamps: torch.Tensor
    cand_timestamps: torch.Tensor
    labels: torch.Tensor  # [candidates, K]


def requests(batches: list, size: int) -> list[Request]:
    """The held-out samples (from ``batches``) re-cut into requests of ``size`` samples."""
    def flat(name):
        return torch.cat([getattr(b, name) for b in batches])
    uih_len, cand = flat("uih_lengths"), flat("cand_counts")
    uih_ids = torch.cat([b.seq_features[b.seq_features.keys()[0]].values() for b in batches])
    cand_ids = torch.cat([b.seq_features[b.seq_features.keys()[1]].values() for b in batches])
    users = torch.cat([b.user_features.values() for b in batches])
    uih_ts, cand_ts, labels = flat("uih_timestamps"), flat("cand_timestamps"), flat("labels")
    uih_off = np.concatenate([[0], np.cumsum(uih_len.numpy())])
    cand_off = np.concatenate([[0], np.cumsum(cand.numpy())])
    out = []
    for lo in range(0, len(uih_len), size):
        hi = min(lo + size, len(uih_len))
        u, c = slice(uih_off[lo], uih_off[hi]), slice(cand_off[lo], cand_off[hi])
        out.append(Request(uih_ids[u], uih_len[lo:hi], cand_ids[c], cand[lo:hi], users[lo:hi], uih_ts[u], cand_ts[c],
                           labels[c]))
    return out


def serve(model, r: Request, k: int = TOP_K) -> torch.Tensor:
    """What a serving process asks of the export for request ``r``: the candidates' logits
    (ranking) or each user's top ``k`` items (retrieval)."""
    if model.task == "retrieval":
        return model.topk(r.uih_ids, r.uih_lengths, r.uih_timestamps, k)
    return model.predict(r.uih_ids, r.uih_lengths, r.cand_ids, r.cand_counts, r.user_ids,
                         uih_timestamps=r.uih_timestamps, cand_timestamps=r.cand_timestamps)


def ranking_accuracy(model, batches: list, size: int, samples: int) -> dict:
    """Each label's held-out AUC and NE of the export against the trained model's."""
    logits, labels = [], []
    for r in requests(batches, size):
        logits.append(serve(model, r))
        labels.append(r.labels)
    exported = heldout_metrics(torch.cat(labels).numpy(), torch.cat(logits).numpy(), samples, model.labels)
    trained = model.manifest["heldout"]
    return {"exported": exported, "trained_fp32": {k: trained[k] for k in ("samples", "candidates", "auc", "ne", "labels")},
            "auc_diff": round(exported["auc"] - trained["auc"], 6), "ne_diff": round(exported["ne"] - trained["ne"], 6),
            "labels": {name: {"auc_diff": round(exported["labels"][name]["auc"] - trained["labels"][name]["auc"], 6),
                              "ne_diff": round(exported["labels"][name]["ne"] - trained["labels"][name]["ne"], 6)}
                       for name in model.labels}}


def retrieval_accuracy(model, batches: list, ks: list[int], exclude_history: bool) -> dict:
    """HR@K, NDCG@K and MRR of the export (its user tower's queries against its item vectors,
    ranked by ``freescale.train.retrieval.target_ranks``) against the trained model's, on the
    same held-out users."""
    from freescale.train.retrieval import held_out_users, rank_metrics, target_ranks

    queries, targets, histories = [], [], []
    for batch in batches:
        has, target, history = held_out_users(batch)
        seq = batch.seq_features
        queries.append(model.queries(seq[seq.keys()[0]].values(), batch.uih_lengths, batch.uih_timestamps)[has])
        targets.append(target)
        histories += history
    ranks = target_ranks(torch.cat(queries), model.items, 0, np.concatenate(targets).astype(np.int64), histories,
                         exclude_history)
    exported = rank_metrics(ranks, ks)
    trained = {k: v for k, v in model.manifest["heldout"].items() if k.startswith("eval/")}
    return {"exported": exported, "trained_fp32": trained,
            "diff": {k: round(exported[k] - trained[k], 6) for k in exported if k in trained and k != "eval/users"}}


def bench(folder: str, batch_sizes: list[int], threads: int | None = None, log=print) -> dict:
    check_bench(folder, batch_sizes, threads)
    if threads is not None:
        torch.set_num_threads(threads)
    model = load_export(folder)
    manifest = model.manifest
    cfg = load_config(os.path.join(folder, "config.yaml"))
    batches = held_out(cfg)
    samples = sum(int(b.uih_lengths.numel()) for b in batches)

    # Accuracy: every held-out sample once, against the trained model's figures.
    if model.task == "retrieval":
        accuracy = retrieval_accuracy(model, batches, cfg.task.eval_ks, cfg.task.exclude_history)
    else:
        accuracy = ranking_accuracy(model, batches, max(batch_sizes), samples)

    rows = []
    progress = bar(total=len(batch_sizes), desc="serve-bench", unit="batch size")
    for size in batch_sizes:
        reqs = requests(batches, size)
        for r in reqs[:WARMUP]:
            serve(model, r)
        times = []
        for r in reqs:
            t0 = time.perf_counter()
            serve(model, r)
            times.append(time.perf_counter() - t0)
        served = sum(int(r.uih_lengths.numel()) for r in reqs)
        ms = np.array(times) * 1e3
        rows.append({"batch_size": size, "requests": len(reqs), "samples": served,
                     "latency_ms_p50": round(float(np.percentile(ms, 50)), 3),
                     "latency_ms_p99": round(float(np.percentile(ms, 99)), 3),
                     "queries_per_s": round(served / float(np.sum(times)), 1)})
        progress.update()
    progress.close()
    return {"export": os.path.abspath(folder), "model": manifest["model"], "quantize": manifest["quantize"],
            "threads": torch.get_num_threads(), "size_bytes": manifest["size_bytes"], "files": manifest["files"],
            "heldout_samples": samples, "accuracy": accuracy, "latency": rows}


def format_result(result: dict) -> str:
    acc = result["accuracy"]
    lines = [f"export {result['export']} ({result['model']['kind']} {result['model']['task']}, {result['quantize']}, "
             f"{result['size_bytes'] / 2**20:.2f} MiB, {result['threads']} thread(s))"]
    if result["model"]["task"] == "retrieval":
        ex, tr = acc["exported"], acc["trained_fp32"]
        lines.append(f"held-out over {ex['eval/users']} users (leave-one-out, whole table): " + ", ".join(
            f"{k.removeprefix('eval/')} {ex[k]:.4f} (trained fp32 {tr[k]:.4f}, diff {acc['diff'][k]:+.4f})"
            for k in ex if k in acc["diff"]))
        what = f"top-{TOP_K} requests"
    else:
        for name, per in acc["exported"]["labels"].items():
            trained, diff = acc["trained_fp32"]["labels"][name], acc["labels"][name]
            lines.append(f"held-out {name} over {result['heldout_samples']} samples: AUC {per['auc']:.4f} "
                         f"(trained fp32 {trained['auc']:.4f}, diff {diff['auc_diff']:+.4f}), NE {per['ne']:.4f} "
                         f"(trained fp32 {trained['ne']:.4f}, diff {diff['ne_diff']:+.4f})")
        what = "requests"
    lines += [f"| batch size | {what} | latency p50 ms | latency p99 ms | queries/s |", "|---|---|---|---|---|"]
    for r in result["latency"]:
        lines.append(f"| {r['batch_size']} | {r['requests']} | {r['latency_ms_p50']:.3f} | {r['latency_ms_p99']:.3f} | "
                     f"{r['queries_per_s']:.1f} |")
    return "\n".join(lines)
