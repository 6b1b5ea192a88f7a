"""A FreeScale export, loaded and served with torch, TorchRec and fbgemm alone.

This file is copied into every export folder as ``serve.py``; it imports nothing of FreeScale,
so a serving process needs only the ecosystem's packages:

    import importlib.util
    spec = importlib.util.spec_from_file_location("serve", "EXPORT/serve.py")
    serve = importlib.util.module_from_spec(spec); spec.loader.exec_module(serve)
    model = serve.load("EXPORT")
    logits = model.predict(uih_ids, uih_lengths, cand_ids, cand_counts, user_ids)            # transformer ranking
    logits = model.predict(uih_ids, uih_lengths, cand_ids, cand_counts, user_ids,
                           uih_timestamps=uih_ts, cand_timestamps=cand_ts)                    # HSTU ranking
    top = model.topk(uih_ids, uih_lengths, uih_timestamps, k=10)                              # HSTU retrieval

The folder holds ``manifest.json`` (what the model is), ``tables.pt`` (each embedding table
quantized row-wise as TorchRec's quantized modules store it: the rows' bytes, and for int8 /
int4 each row's fp16 scale and bias) and ``dense.pt2`` (the dense part, a ``torch.export``
program over padded inputs: the ranking model, or for retrieval the user tower); a retrieval
export also holds ``items.pt``, the item tower precomputed: every row of the quantized item
table, dequantized and L2-normalized. The tables are looked up by TorchRec's quantized
``EmbeddingCollection``, which runs fbgemm's ``IntNBitTableBatchedEmbeddingBagsCodegen`` (on
CPU here); the looked-up rows are padded per sample and given to the dense program.

Inputs, one entry per sample: ``uih_ids`` (the item ids of every history, back to back, oldest
first) with ``uih_lengths``, ``cand_ids`` with ``cand_counts``, ``user_ids`` (already hashed
into the user table: ``id % manifest["user_hash_size"]``; ignored when the model has no user
feature) and, for HSTU (``manifest["model"]["kind"] == "hstu"``), each history event's and each
candidate's time in seconds (``uih_timestamps``, ``cand_timestamps``, int64, aligned with the
ids): the program computes the relative time buckets from them. A history longer than the
trained one (``manifest["max_uih_len"]``) is cut to its latest events, as training cuts it.
``predict`` returns the candidates' logits [sum(cand_counts), K], one column per label
(``manifest["labels"]``; K = 1 is [N, 1]), in order. ``topk`` returns each user's ``k`` best
item ids [B, k], best first, leaving out (``exclude_history``) the items already in the user's
history as training's held-out evaluation does; a user without a history has a zero query
(every item scores 0).
"""

from __future__ import annotations

import json
import os

import fbgemm_gpu  # noqa: F401  (registers the fbgemm operators the quantized tables run)
import torch
from torchrec.modules.embedding_configs import DataType, EmbeddingConfig
from torchrec.quant.embedding_modules import EmbeddingCollection as QuantEmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

MANIFEST = "manifest.json"
TABLES = "tables.pt"
DENSE = "dense.pt2"
ITEMS = "items.pt"


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.long)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


def _padded(rows: torch.Tensor, lengths: torch.Tensor, width: int, samples: torch.Tensor | None = None) -> torch.Tensor:
    """Jagged ``rows`` (samples' rows back to back, ``lengths`` each) as [samples, width, ...], of
    the ``samples`` given (default: all); what lies past a sample's length is some other row (the
    dense program masks it out)."""
    offsets = _offsets(lengths)[:-1]
    if samples is not None:
        offsets, lengths = offsets[samples], lengths[samples]
    pos = torch.arange(width)
    real = pos[None, :] < lengths[:, None]
    index = torch.where(real, offsets[:, None] + pos[None, :], torch.zeros_like(pos)[None, :])
    return rows[index] if rows.numel() else rows.new_zeros((lengths.numel(), width, *rows.shape[1:]))


def latest(lengths: torch.Tensor, limit: int, *jagged: torch.Tensor | None):
    """Each history cut to its last ``limit`` events, as training cuts them (``data.max_uih_len``):
    ``(lengths, *jagged)`` with every jagged tensor (aligned with the histories) cut alike."""
    lengths = lengths.long()
    if not lengths.numel() or int(lengths.max()) <= limit:
        return (lengths, *jagged)
    kept = lengths.clamp(max=limit)
    # A kept event: its index within the kept ones, past where its history's kept part starts.
    within = torch.arange(int(kept.sum())) - torch.repeat_interleave(_offsets(kept)[:-1], kept)
    index = torch.repeat_interleave(_offsets(lengths)[1:] - kept, kept) + within
    return (kept, *(None if t is None else t[index] for t in jagged))


def length_groups(lengths: list[int], max_padding: float) -> list[list[int]]:
    """Sample indices grouped so that ``len(group) * max(L) <= max_padding * sum(L)`` (greedy over
    samples by decreasing length), as training groups them: padding every sample of a request
    to its longest history would make each cost the longest one's. (Training's own
    ``group_by_length``, written again here so that this file needs nothing of FreeScale; a test
    holds the two equal.)"""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups, current, longest, total = [], [], 0, 0
    for i in order:
        if current and (len(current) + 1) * longest > max_padding * (total + lengths[i]):
            groups.append(current)
            current, total = [], 0
        if not current:
            longest = lengths[i]
        current.append(i)
        total += lengths[i]
    if current:
        groups.append(current)
    return groups


def quantized_collection(tables: list[dict], weights: dict) -> QuantEmbeddingCollection:
    """TorchRec's quantized ``EmbeddingCollection`` of the manifest's ``tables`` holding ``weights``
    (``tables.pt``: each table's row bytes and, for int8 / int4, scale and bias)."""
    configs = [EmbeddingConfig(name=t["name"], embedding_dim=t["dim"], num_embeddings=t["rows"],
                               feature_names=t["features"], data_type=DataType[t["data_type"]]) for t in tables]
    return QuantEmbeddingCollection(
        configs, device=torch.device("cpu"), output_dtype=torch.float,
        table_name_to_quantized_weights={t["name"]: (weights[t["name"]]["weight"], weights[t["name"]]["scale_shift"])
                                         for t in tables})


class ExportedModel:
    def __init__(self, folder: str) -> None:
        with open(os.path.join(folder, MANIFEST)) as f:
            self.manifest = json.load(f)
        m = self.manifest
        self.embeddings = quantized_collection(m["tables"], torch.load(os.path.join(folder, TABLES), weights_only=True))
        self.dense = torch.export.load(os.path.join(folder, DENSE)).module()
        self.features = m["features"]
        self.dim = m["embedding_dim"]
        self.user_features = m["user_features"]
        self.max_padding = float(m["config"]["model"]["attention_padding"])
        self.kind, self.task = m["model"]["kind"], m["model"]["task"]
        self.labels = m["labels"]
        self.max_uih_len = int(m["max_uih_len"])
        self.items = (torch.load(os.path.join(folder, ITEMS), weights_only=True) if self.task == "retrieval"
                      else None)

    def _rows(self, uih_ids, uih_lengths, cand_ids, cand_counts, user_ids):
        """The quantized tables' rows (dequantized to fp32): histories', candidates', users' [B, D]."""
        n = uih_lengths.numel()
        keys = [self.features["uih"], self.features["candidates"]]
        values = [uih_ids, cand_ids]
        lengths = [uih_lengths, cand_counts]
        if self.user_features:
            keys.append(self.features["user"])
            values.append(user_ids)
            lengths.append(torch.ones(n, dtype=torch.long))
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values).long(),
                                                  lengths=torch.cat(lengths).int())
        rows = self.embeddings(kjt)
        user = rows[keys[2]].values() if self.user_features else torch.zeros(n, self.dim)
        return rows[keys[0]].values(), rows[keys[1]].values(), user

    def _needs_timestamps(self, *timestamps) -> None:
        if self.kind == "hstu" and any(t is None for t in timestamps):
            raise ValueError("this export is an HSTU model: pass uih_timestamps (and for predict cand_timestamps), "
                             "each event's time in seconds")

    @torch.no_grad()
    def predict(self, uih_ids: torch.Tensor, uih_lengths: torch.Tensor, cand_ids: torch.Tensor,
                cand_counts: torch.Tensor, user_ids: torch.Tensor | None = None,
                uih_timestamps: torch.Tensor | None = None, cand_timestamps: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [sum(cand_counts), K] of a ranking export (see the module docstring)."""
        if self.task != "ranking":
            raise ValueError(f"predict scores candidates of a ranking export; this one is {self.task} (use topk)")
        self._needs_timestamps(uih_timestamps, cand_timestamps)
        uih_lengths, uih_ids, uih_timestamps = latest(uih_lengths, self.max_uih_len, uih_ids, uih_timestamps)
        n = uih_lengths.numel()
        out = torch.zeros(int(cand_counts.sum()), len(self.labels))
        if n == 0:
            return out
        uih_rows, cand_rows, user = self._rows(uih_ids, uih_lengths, cand_ids, cand_counts, user_ids)
        uih_lengths, cand_counts = uih_lengths.long(), cand_counts.long()
        cand_at = _offsets(cand_counts)[:-1]
        # Samples of similar history lengths go through the program together, each group padded
        # to its own longest (at least 2: the program was exported for widths of 2 and more).
        for group in length_groups(uih_lengths.tolist(), self.max_padding):
            samples = torch.tensor(group, dtype=torch.long)
            lengths, counts = uih_lengths[samples], cand_counts[samples]
            width, cands = max(2, int(lengths.max())), max(2, int(counts.max()))
            uih = _padded(uih_rows, uih_lengths, width, samples)
            cand = _padded(cand_rows, cand_counts, cands, samples)
            if self.kind == "hstu":
                logits = self.dense(uih, lengths, _padded(uih_timestamps.long(), uih_lengths, width, samples), cand,
                                    counts, _padded(cand_timestamps.long(), cand_counts, cands, samples), user[samples])
            else:
                logits = self.dense(uih, lengths, cand, counts, user[samples])
            pos = torch.arange(cands)
            real = pos[None, :] < counts[:, None]
            out[(cand_at[samples][:, None] + pos[None, :])[real]] = logits[real]
        return out

    @torch.no_grad()
    def queries(self, uih_ids: torch.Tensor, uih_lengths: torch.Tensor, uih_timestamps: torch.Tensor) -> torch.Tensor:
        """A retrieval export's user tower: each user's L2-normalized query [B, D] (zeros without a history)."""
        if self.task != "retrieval":
            raise ValueError(f"queries and topk need a retrieval export; this one is {self.task} (use predict)")
        self._needs_timestamps(uih_timestamps)
        uih_lengths, uih_ids, uih_timestamps = latest(uih_lengths, self.max_uih_len, uih_ids, uih_timestamps)
        out = torch.zeros(uih_lengths.numel(), self.items.shape[1])
        if not uih_lengths.numel():
            return out
        uih_rows, _, _ = self._rows(uih_ids, uih_lengths, uih_ids[:0], torch.zeros_like(uih_lengths),
                                    torch.zeros_like(uih_lengths))
        for group in length_groups(uih_lengths.tolist(), self.max_padding):
            samples = torch.tensor(group, dtype=torch.long)
            width = max(2, int(uih_lengths[samples].max()))
            out[samples] = self.dense(_padded(uih_rows, uih_lengths, width, samples), uih_lengths[samples],
                                      _padded(uih_timestamps.long(), uih_lengths, width, samples))
        return out

    @torch.no_grad()
    def topk(self, uih_ids: torch.Tensor, uih_lengths: torch.Tensor, uih_timestamps: torch.Tensor, k: int,
             exclude_history: bool = True) -> torch.Tensor:
        """Each user's ``k`` best item ids [B, k], best first (see the module docstring)."""
        scores = self.queries(uih_ids, uih_lengths, uih_timestamps) @ self.items.T
        if exclude_history:
            owner = torch.repeat_interleave(torch.arange(uih_lengths.numel()), uih_lengths.long())
            scores[owner, uih_ids.long()] = float("-inf")
        return scores.topk(k, dim=1).indices


def load(folder: str) -> ExportedModel:
    """The exported model in ``folder``."""
    return ExportedModel(folder)


if __name__ == "__main__":  # python serve.py FOLDER: load it and say what it is
    import sys

    model = load(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))
    print(json.dumps({k: model.manifest[k] for k in ("model", "labels", "quantize", "tables", "heldout")}, indent=2))
