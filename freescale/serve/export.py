"""``freescale export``: an inference model from a training checkpoint, loadable without FreeScale.

From a run folder's checkpoint (any pipeline, any number of ranks) the model's tensors are read
whole: DCP reassembles every sharded table (TorchRec's row- or column-wise shards, FreeScale's
own row-wise blocks) into one tensor, with no process group. Then:

- each embedding table is quantized row-wise (``--quantize``: fp32, fp16, int8, int4) exactly
  as TorchRec's quantized ``EmbeddingCollection`` stores it (``quantize_state_dict``: fbgemm's
  ``FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf``, an fp16 scale and bias per row for int8 and
  int4), saved as plain tensors in ``tables.pt``;
- the dense part is captured by ``torch.export`` into ``dense.pt2``: a program, not FreeScale's
  code, that ``torch.export.load`` runs with dynamic batch, history and candidate sizes. It is
  the training forward over padded inputs: ``ServingDense`` (transformer ranking),
  ``ServingHSTURanking`` (HSTU ranking) or ``ServingHSTUQuery`` (HSTU retrieval's user tower;
  the item tower, every row of the quantized item table L2-normalized, is precomputed into
  ``items.pt``);
- the trained model (FreeScale's training forward, fp32) is evaluated on the held-out set (per
  label AUC / NE, or retrieval's HR@K / NDCG@K / MRR by leave-one-out against the whole table,
  ``freescale.train.retrieval`` in this one process), and ``manifest.json`` records the model
  and task kinds, the label names, the config, the tables (rows, width, quantization), the
  held-out figures and the files' sizes; ``config.yaml`` is the run's config, ``serve.py`` the
  loader (``freescale.serve.standalone``: torch, TorchRec and fbgemm only).

The folder is written next to ``--out`` and renamed into place once complete: an export that
fails leaves nothing half-written. A model that reads side features (``model.side_features``) is
refused: the served program and ``serve.py`` take item and user ids only.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from freescale.config import ExperimentConfig, dump_yaml, to_dict
from freescale.data.batch import CANDIDATE_FEATURE, UIH_FEATURE, USER_FEATURE
from freescale.data.features import label_names
from freescale.model.seqrec import ITEM_TABLE, USER_TABLE, SeqRecModel, SeqRecTask, task_settings
from freescale.progress import bar
from freescale.serve import standalone
from freescale.serve.checks import QUANTIZATIONS, ExportError, check_destination, exportable_config, find_checkpoint
from freescale.serve.dense import ServingDense

FORMAT = "freescale-export/1"


@dataclass
class Trained:
    """A checkpoint's model, whole: its tables and the dense part's state."""

    cfg: ExperimentConfig
    run_dir: str
    step: int
    checkpoint: str
    tables: dict[str, torch.Tensor]
    task_state: dict[str, torch.Tensor]


def read_trained(run_dir: str, step: int | None = None) -> Trained:
    """The checkpoint's tables and dense state, whole (no process group needed)."""
    step, path = find_checkpoint(run_dir, step)
    cfg = exportable_config(run_dir)
    try:
        meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as e:
        raise ExportError(f"{path}: unreadable checkpoint ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    wanted = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
              if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "no process group: loading in one process" is what is meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(wanted, checkpoint_id=path, no_dist=True)
    tables, task = {}, {}
    for key, value in wanted.items():
        for name in (ITEM_TABLE, USER_TABLE):
            if key.endswith(f".{name}.weight"):
                tables[name] = value
        if "task." in key:
            task[key.split("task.", 1)[1]] = value
    if ITEM_TABLE not in tables or not task:
        raise ExportError(f"{path}: no model in the checkpoint (expected the {ITEM_TABLE} table and the dense task)")
    if cfg.model.user_features and USER_TABLE not in tables:
        raise ExportError(f"{path}: model.user_features is on but the checkpoint has no {USER_TABLE}")
    return Trained(cfg, run_dir, step, path, tables, task)


def trained_model(trained: Trained) -> SeqRecModel:
    """The trained model as training computes it (fp32, unsharded, on CPU)."""
    cfg = trained.cfg
    model = SeqRecModel(cfg.model, cfg.embedding, num_items=int(trained.tables[ITEM_TABLE].shape[0]),
                        device=torch.device("cpu"), **task_settings(cfg))
    with torch.no_grad():
        model.item_ec.embeddings[ITEM_TABLE].weight.copy_(trained.tables[ITEM_TABLE])
        if model.user_ebc is not None:
            model.user_ebc.embedding_bags[USER_TABLE].weight.copy_(trained.tables[USER_TABLE])
    model.task.load_state_dict(trained.task_state)
    return model.eval()


def held_out(cfg: ExperimentConfig) -> list:
    """The run's held-out batches (its first ``data.eval_samples`` held-out samples, one rank)."""
    from freescale.data.loader import build_sources, eval_batches

    _, source = build_sources(cfg.data, cfg.run.seed, task=cfg.task)
    return eval_batches(source, num_samples=cfg.data.eval_samples, batch_size=cfg.data.batch_size, rank=0,
                        world_size=1, user_hash_size=cfg.model.user_hash_size)


def heldout_metrics(labels: np.ndarray, logits: np.ndarray, samples: int, names: list[str]) -> dict:
    """AUC and NE of each label (``labels``, ``logits`` [candidates, K]; ``names`` the K labels'),
    the first label's also at the top level."""
    from freescale.train.metrics import auc, normalized_entropy

    labels, logits = labels.reshape(len(labels), -1), logits.reshape(len(logits), -1)
    per_label = {name: {"auc": round(auc(labels[:, i], logits[:, i]), 6),
                        "ne": round(normalized_entropy(labels[:, i], logits[:, i]), 6)} for i, name in enumerate(names)}
    return {"samples": samples, "candidates": int(len(labels)), **per_label[names[0]], "labels": per_label}

def evaluate_trained(model: SeqRecModel, batches: list, cfg: ExperimentConfig) -> dict:
    """The trained model's held-out figures: per label AUC / NE (ranking), or HR@K, NDCG@K and MRR
    of leave-one-out against the whole item table (retrieval, ``freescale.train.retrieval`` in
    this one process)."""

    with torch.no_grad():
        if cfg.task.kind == "retrieval":
            from freescale.train.retrieval import evaluate_retrieval

            return evaluate_retrieval(model, batches, num_items=model.item_ec.embeddings[ITEM_TABLE].num_embeddings,
                                      ks=cfg.task.eval_ks, exclude_history=cfg.task.exclude_history, group=None,
                                      user_hash_size=cfg.model.user_hash_size)
        logits, labels = [], []
        for batch in batches:
            _, out = model(batch)
            logits.append(out.logits)
            labels.append(out.labels)
    samples = sum(int(b.uih_lengths.numel()) for b in batches)
    return heldout_metrics(torch.cat(labels).numpy(), torch.cat(logits).numpy(), samples,
                           label_names(cfg.data, cfg.task.kind))


def quantized_tables(trained: Trained, quantize: str) -> tuple[list[dict], dict]:
    """The tables' specs and their row-wise quantized weights, as TorchRec's quantized
    ``EmbeddingCollection`` takes them."""
    from torchrec.modules.embedding_configs import DataType, EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection
    from torchrec.quant.embedding_modules import quantize_state_dict

    features = {ITEM_TABLE: [UIH_FEATURE, CANDIDATE_FEATURE], USER_TABLE: [USER_FEATURE]}
    names = [n for n in (ITEM_TABLE, USER_TABLE) if n in trained.tables and (n == ITEM_TABLE or trained.cfg.model.user_features)]
    specs = [{"name": n, "rows": int(trained.tables[n].shape[0]), "dim": int(trained.tables[n].shape[1]),
              "data_type": QUANTIZATIONS[quantize], "features": features[n]} for n in names]
    floats = EmbeddingCollection(tables=[EmbeddingConfig(name=s["name"], embedding_dim=s["dim"], num_embeddings=s["rows"],
                                                         feature_names=s["features"]) for s in specs],
                                 device=torch.device("meta"))
    floats = floats.to_empty(device="cpu")
    with torch.no_grad():
        for n in names:
            floats.embeddings[n].weight.copy_(trained.tables[n])
    quantized: dict = {}
    quantize_state_dict(floats, quantized, {s["name"]: DataType[s["data_type"]] for s in specs})
    return specs, {n: {"weight": w.contiguous(), "scale_shift": None if ss is None else ss.contiguous()}
                   for n, (w, ss) in quantized.items()}


def serving_program(task: nn.Module) -> tuple[nn.Module, tuple, dict, str]:
    """(the padded module, an example input, its dynamic shapes, what it takes and returns) of
    ``task``'s serving form: ``ServingDense`` for the transformer, ``ServingHSTURanking`` and
    ``ServingHSTUQuery`` (the user tower) for HSTU's tasks."""
    from torch.export import Dim

    from freescale.model.hstu_tasks import HSTURankingTask, HSTURetrievalTask
    from freescale.serve.hstu_dense import ServingHSTUQuery, ServingHSTURanking

    dim = task.cfg.embedding_dim
    gen = torch.Generator().manual_seed(0)
    uih, uih_lengths = torch.randn(3, 5, dim, generator=gen), torch.tensor([5, 1, 3])
    cand, cand_counts = torch.randn(3, 4, dim, generator=gen), torch.tensor([4, 2, 1])
    user = torch.randn(3, dim, generator=gen)
    uih_ts, cand_ts = torch.arange(15).view(3, 5) * 1000, torch.arange(12).view(3, 4) * 1000 + 20000
    batch, history, candidates = Dim("batch", min=1), Dim("history", min=2), Dim("candidates", min=2)
    rows, seconds, counts = {0: batch, 1: history}, {0: batch, 1: history}, {0: batch}
    cands, cand_seconds = {0: batch, 1: candidates}, {0: batch, 1: candidates}
    pad = "B >= 1, L >= 2, C >= 2 (pad with anything: past a length nothing is read)"
    if isinstance(task, HSTURetrievalTask):
        return (ServingHSTUQuery(task), (uih, uih_lengths, uih_ts),
                {"uih": rows, "uih_lengths": counts, "uih_timestamps": seconds},
                f"uih [B, L, D], uih_lengths [B], uih_timestamps [B, L] (int64 seconds); {pad} -> queries [B, D] "
                "(L2-normalized, zeros for an empty history)")
    if isinstance(task, HSTURankingTask):
        return (ServingHSTURanking(task), (uih, uih_lengths, uih_ts, cand, cand_counts, cand_ts, user),
                {"uih": rows, "uih_lengths": counts, "uih_timestamps": seconds, "cand": cands, "cand_counts": counts,
                 "cand_timestamps": cand_seconds, "user": counts},
                f"uih [B, L, D], uih_lengths [B], uih_timestamps [B, L], cand [B, C, D], cand_counts [B], "
                f"cand_timestamps [B, C] (int64 seconds), user [B, D]; {pad} -> logits [B, C, K]")
    uih_lengths = torch.tensor([5, 0, 3])
    return (ServingDense(task), (uih, uih_lengths, cand, cand_counts, user),
            {"uih": rows, "uih_lengths": counts, "cand": cands, "cand_counts": counts, "user": counts},
            f"uih [B, L, D], uih_lengths [B], cand [B, C, D], cand_counts [B], user [B, D]; {pad} -> logits [B, C, K]")


def export_dense(task: nn.Module, path: str) -> str:
    """``task``'s serving form, captured by ``torch.export`` with dynamic sizes, saved to ``path``;
    returns what the program takes and returns."""
    module, example, shapes, signature = serving_program(task)
    program = torch.export.export(module.eval(), example, dynamic_shapes=shapes)
    torch.export.save(program, path)
    return signature


def export(run_dir: str, out: str, *, step: int | None = None, quantize: str = "int8") -> dict:
    """Write the export folder ``out`` of ``run_dir``'s checkpoint; returns its manifest."""
    check_destination(out, quantize)
    phases = bar(total=5, desc="export", unit="phase")
    try:
        phases.set_postfix_str("reading the checkpoint")
        trained = read_trained(run_dir, step)
        phases.update()
        phases.set_postfix_str("evaluating the trained model")
        model = trained_model(trained)
        metrics = evaluate_trained(model, held_out(trained.cfg), trained.cfg)
        phases.update()
        return write_export(trained, model.task, metrics, out, quantize, phases)
    finally:
        phases.close()


def item_vectors(task: nn.Module, specs: list[dict], weights: dict) -> torch.Tensor:
    """The item tower over the whole item table as served: every row of the quantized table,
    looked up (dequantized) by TorchRec's quantized module as ``serve.py`` does, through the
    task's ``item_vectors``."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    spec = next(s for s in specs if s["name"] == ITEM_TABLE)
    collection = standalone.quantized_collection([spec], weights)
    rows = spec["rows"]
    ids = KeyedJaggedTensor.from_lengths_sync(keys=[UIH_FEATURE, CANDIDATE_FEATURE], values=torch.arange(rows),
                                              lengths=torch.tensor([rows, 0], dtype=torch.int32))
    with torch.no_grad():
        return task.item_vectors(collection(ids)[UIH_FEATURE].values()).contiguous()


def folder_mode() -> int:
    """The mode ``os.makedirs`` gives a folder: 0o777 less this process's umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o777 & ~mask


def write_export(trained: Trained, task: SeqRecTask, metrics: dict, out: str, quantize: str, phases=None) -> dict:
    """The export folder of ``trained`` (its dense part loaded in ``task``; ``metrics``: the trained
    model's held-out figures), written beside ``out`` and renamed into place."""
    check_destination(out, quantize)
    phases = phases if phases is not None else bar(total=3, desc="export", unit="phase")
    cfg = trained.cfg
    parent = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out))}.", dir=parent)
    try:
        os.chmod(tmp, folder_mode())  # (mkdtemp's folder is its owner's alone; an export is to be served)
        phases.set_postfix_str(f"quantizing the tables ({quantize})")
        specs, weights = quantized_tables(trained, quantize)
        torch.save(weights, os.path.join(tmp, standalone.TABLES))
        phases.update()
        phases.set_postfix_str("exporting the dense part")
        signature = export_dense(task, os.path.join(tmp, standalone.DENSE))
        files = [standalone.TABLES, standalone.DENSE]
        if cfg.task.kind == "retrieval":
            torch.save(item_vectors(task, specs, weights), os.path.join(tmp, standalone.ITEMS))
            files.append(standalone.ITEMS)
        phases.update()
        shutil.copyfile(standalone.__file__, os.path.join(tmp, "serve.py"))
        with open(os.path.join(tmp, "config.yaml"), "w") as f:
            f.write(dump_yaml(cfg))
        files = {name: os.path.getsize(os.path.join(tmp, name)) for name in files}
        manifest = {
            "format": FORMAT,
            "quantize": quantize,
            "model": {"kind": cfg.model.kind, "task": cfg.task.kind},
            "labels": label_names(cfg.data, cfg.task.kind),
            "source": {"run_dir": os.path.abspath(trained.run_dir), "step": trained.step, "checkpoint": trained.checkpoint,
                       "pipeline": cfg.train.pipeline},
            "tables": specs,
            "features": {"uih": UIH_FEATURE, "candidates": CANDIDATE_FEATURE, "user": USER_FEATURE},
            "embedding_dim": cfg.model.embedding_dim,
            "user_features": cfg.model.user_features,
            "user_hash_size": cfg.model.user_hash_size,
            "max_uih_len": cfg.data.max_uih_len,
            "dense": {"file": standalone.DENSE, "format": "torch.export ExportedProgram (torch.export.load)",
                      "signature": signature},
            **({"items": {"file": standalone.ITEMS, "what": "every item's vector [rows, D]: the quantized item table's "
                          "rows, dequantized, L2-normalized (the item tower)"}} if cfg.task.kind == "retrieval" else {}),
            "heldout": {**metrics, "of": "the trained model (fp32, FreeScale's training forward)"},
            "files": files,
            "size_bytes": sum(files.values()),
            "config": to_dict(cfg),
        }
        with open(os.path.join(tmp, standalone.MANIFEST), "w") as f:
            json.dump(manifest, f, indent=2)
        os.replace(tmp, out)  # atomic; replaces an empty folder ``out`` (checked above)
        phases.update()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest
