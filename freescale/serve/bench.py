"""``freescale serve-bench``: an export's latency, throughput, accuracy and size.

The model is loaded by the export's own ``serve.py`` (what a serving process runs). For each
batch size the run's held-out samples (regenerated from the export's ``config.yaml``) are cut
into batches of that size and each batch is one request: after a warm-up, every request's
latency is timed (p50, p99) and queries/s counts samples (a query is one sample and its
candidates) over the time spent in requests. The exported model's held-out AUC and NE over the
same samples, for the first label (``label_names(...)[0]``), are set against the trained fp32
model's, which the export recorded.
"""

from __future__ import annotations

import importlib.util
import os
import time

import numpy as np
import torch

from freescale.config import load_config
from freescale.progress import bar
from freescale.serve.export import ExportError, held_out, heldout_metrics

WARMUP = 3  # requests before timing (allocator, first calls into fbgemm)


def load_export(folder: str):
    """The export in ``folder``, loaded by its own ``serve.py``."""
    path = os.path.join(folder, "serve.py")
    if not os.path.isfile(os.path.join(folder, "manifest.json")) or not os.path.isfile(path):
        raise ExportError(f"not an export folder (no manifest.json and serve.py): {folder}")
    spec = importlib.util.spec_from_file_location(f"freescale_export_{abs(hash(folder))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.load(folder)


def requests(batches: list, size: int) -> list[tuple]:
    """The held-out samples (from ``batches``) re-cut into requests of ``size`` samples:
    (uih ids, uih lengths, candidate ids, candidate counts, user ids, labels [candidates, K])."""
    def flat(name):
        return [getattr(b, name) for b in batches]
    uih_len = torch.cat(flat("uih_lengths"))
    cand = torch.cat(flat("cand_counts"))
    uih_ids = torch.cat([b.seq_features[b.seq_features.keys()[0]].values() for b in batches])
    cand_ids = torch.cat([b.seq_features[b.seq_features.keys()[1]].values() for b in batches])
    users = torch.cat([b.user_features.values() for b in batches])
    labels = torch.cat(flat("labels"))
    uih_off = np.concatenate([[0], np.cumsum(uih_len.numpy())])
    cand_off = np.concatenate([[0], np.cumsum(cand.numpy())])
    out = []
    for lo in range(0, len(uih_len), size):
        hi = min(lo + size, len(uih_len))
        out.append((uih_ids[uih_off[lo]:uih_off[hi]], uih_len[lo:hi], cand_ids[cand_off[lo]:cand_off[hi]], cand[lo:hi],
                    users[lo:hi], labels[cand_off[lo]:cand_off[hi]]))
    return out


def bench(folder: str, batch_sizes: list[int], threads: int | None = None, log=print) -> dict:
    if any(b < 1 for b in batch_sizes):
        raise ExportError(f"--batch-sizes: expected sizes >= 1, got {batch_sizes}")
    if threads is not None:
        if threads < 1:
            raise ExportError(f"--threads: expected at least 1, got {threads}")
        torch.set_num_threads(threads)
    model = load_export(folder)
    manifest = model.manifest
    cfg = load_config(os.path.join(folder, "config.yaml"))
    batches = held_out(cfg)
    samples = sum(int(b.uih_lengths.numel()) for b in batches)

    # Accuracy: every held-out sample once, against the trained model's figures.
    logits, labels = [], []
    for uih, uih_len, cand, counts, users, y in requests(batches, max(batch_sizes)):
        logits.append(model.predict(uih, uih_len, cand, counts, users))
        labels.append(y)
    labels, logits = torch.cat(labels), torch.cat(logits)
    # The first label, against the first head's logits whether the model has one head or K.
    exported = heldout_metrics(labels[:, 0].numpy(), logits.reshape(len(labels), -1)[:, 0].numpy(), samples)
    trained = manifest["heldout"]
    accuracy = {"exported": exported, "trained_fp32": {k: trained[k] for k in ("samples", "candidates", "auc", "ne")},
                "auc_diff": round(exported["auc"] - trained["auc"], 6),
                "ne_diff": round(exported["ne"] - trained["ne"], 6)}

    rows = []
    progress = bar(total=len(batch_sizes), desc="serve-bench", unit="batch size")
    for size in batch_sizes:
        reqs = requests(batches, size)
        for r in reqs[:WARMUP]:
            model.predict(*r[:5])
        times = []
        for r in reqs:
            t0 = time.perf_counter()
            model.predict(*r[:5])
            times.append(time.perf_counter() - t0)
        served = sum(int(r[1].numel()) for r in reqs)
        ms = np.array(times) * 1e3
        rows.append({"batch_size": size, "requests": len(reqs), "samples": served,
                     "latency_ms_p50": round(float(np.percentile(ms, 50)), 3),
                     "latency_ms_p99": round(float(np.percentile(ms, 99)), 3),
                     "queries_per_s": round(served / float(np.sum(times)), 1)})
        progress.update()
    progress.close()
    return {"export": os.path.abspath(folder), "quantize": manifest["quantize"], "threads": torch.get_num_threads(),
            "size_bytes": manifest["size_bytes"], "files": manifest["files"], "heldout_samples": samples,
            "accuracy": accuracy, "latency": rows}


def format_result(result: dict) -> str:
    acc = result["accuracy"]
    lines = [f"export {result['export']} ({result['quantize']}, {result['size_bytes'] / 2**20:.2f} MiB, "
             f"{result['threads']} thread(s))",
             f"held-out over {result['heldout_samples']} samples: AUC {acc['exported']['auc']:.4f} "
             f"(trained fp32 {acc['trained_fp32']['auc']:.4f}, diff {acc['auc_diff']:+.4f}), "
             f"NE {acc['exported']['ne']:.4f} (trained fp32 {acc['trained_fp32']['ne']:.4f}, diff {acc['ne_diff']:+.4f})",
             "| batch size | requests | latency p50 ms | latency p99 ms | queries/s |", "|---|---|---|---|---|"]
    for r in result["latency"]:
        lines.append(f"| {r['batch_size']} | {r['requests']} | {r['latency_ms_p50']:.3f} | {r['latency_ms_p99']:.3f} | "
                     f"{r['queries_per_s']:.1f} |")
    return "\n".join(lines)
