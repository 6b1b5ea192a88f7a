"""A FreeScale export, loaded and served with torch, TorchRec and fbgemm alone.

This file is copied into every export folder as ``serve.py``; it imports nothing of FreeScale,
so a serving process needs only the ecosystem's packages:

    import importlib.util
    spec = importlib.util.spec_from_file_location("serve", "EXPORT/serve.py")
    serve = importlib.util.module_from_spec(spec); spec.loader.exec_module(serve)
    model = serve.load("EXPORT")
    logits = model.predict(uih_ids, uih_lengths, cand_ids, cand_counts, user_ids)

The folder holds ``manifest.json`` (what the model is), ``tables.pt`` (each embedding table
quantized row-wise as TorchRec's quantized modules store it: the rows' bytes, and for int8 /
int4 each row's fp16 scale and bias) and ``dense.pt2`` (the dense part, a ``torch.export``
program over padded inputs). The tables are looked up by TorchRec's quantized
``EmbeddingCollection``, which runs fbgemm's ``IntNBitTableBatchedEmbeddingBagsCodegen`` (on
CPU here); the looked-up rows are padded per sample and given to the dense program.

Inputs, one entry per sample: ``uih_ids`` (the item ids of every history, back to back) with
``uih_lengths``, ``cand_ids`` with ``cand_counts``, and ``user_ids`` (already hashed into the
user table: ``id % manifest["user_hash_size"]``; ignored when the model has no user feature).
``predict`` returns one logit per candidate, in order.
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


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.long)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


def _padded(rows: torch.Tensor, lengths: torch.Tensor, width: int, samples: torch.Tensor | None = None) -> torch.Tensor:
    """Jagged ``rows`` (samples' rows back to back, ``lengths`` each) as [samples, width, dim], of
    the ``samples`` given (default: all); what lies past a sample's length is some other row (the
    dense program masks it out)."""
    offsets = _offsets(lengths)[:-1]
    if samples is not None:
        offsets, lengths = offsets[samples], lengths[samples]
    pos = torch.arange(width)
    real = pos[None, :] < lengths[:, None]
    index = torch.where(real, offsets[:, None] + pos[None, :], torch.zeros_like(pos)[None, :])
    return rows[index] if rows.numel() else rows.new_zeros((lengths.numel(), width, rows.shape[-1]))


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


class ExportedModel:
    def __init__(self, folder: str) -> None:
        with open(os.path.join(folder, MANIFEST)) as f:
            self.manifest = json.load(f)
        m = self.manifest
        weights = torch.load(os.path.join(folder, TABLES), weights_only=True)
        configs = [EmbeddingConfig(name=t["name"], embedding_dim=t["dim"], num_embeddings=t["rows"],
                                   feature_names=t["features"], data_type=DataType[t["data_type"]])
                   for t in m["tables"]]
        self.embeddings = QuantEmbeddingCollection(
            configs, device=torch.device("cpu"), output_dtype=torch.float,
            table_name_to_quantized_weights={t["name"]: (weights[t["name"]]["weight"], weights[t["name"]]["scale_shift"])
                                             for t in m["tables"]})
        self.dense = torch.export.load(os.path.join(folder, DENSE)).module()
        self.features = m["features"]
        self.dim = m["embedding_dim"]
        self.user_features = m["user_features"]
        self.max_padding = float(m["config"]["model"]["attention_padding"])

    @torch.no_grad()
    def predict(self, uih_ids: torch.Tensor, uih_lengths: torch.Tensor, cand_ids: torch.Tensor,
                cand_counts: torch.Tensor, user_ids: torch.Tensor | None = None) -> torch.Tensor:
        n = uih_lengths.numel()
        if n == 0:
            return torch.zeros(0)
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
        uih_rows, cand_rows = rows[keys[0]].values(), rows[keys[1]].values()
        user = rows[keys[2]].values() if self.user_features else torch.zeros(n, self.dim)
        uih_lengths, cand_counts = uih_lengths.long(), cand_counts.long()
        out = torch.empty(int(cand_counts.sum()))
        cand_at = _offsets(cand_counts)[:-1]
        # Samples of similar history lengths go through the program together, each group padded
        # to its own longest (at least 2: the program was exported for widths of 2 and more).
        for group in length_groups(uih_lengths.tolist(), self.max_padding):
            samples = torch.tensor(group, dtype=torch.long)
            lengths, counts = uih_lengths[samples], cand_counts[samples]
            uih = _padded(uih_rows, uih_lengths, max(2, int(lengths.max())), samples)
            cand = _padded(cand_rows, cand_counts, max(2, int(counts.max())), samples)
            logits = self.dense(uih, lengths, cand, counts, user[samples])
            pos = torch.arange(cand.shape[1])
            real = pos[None, :] < counts[:, None]
            out[(cand_at[samples][:, None] + pos[None, :])[real]] = logits[real]
        return out


def load(folder: str) -> ExportedModel:
    """The exported model in ``folder``."""
    return ExportedModel(folder)


if __name__ == "__main__":  # python serve.py FOLDER: load it and say what it is
    import sys

    model = load(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))
    print(json.dumps({k: model.manifest[k] for k in ("quantize", "tables", "heldout")}, indent=2))
