"""The sequence recommendation model.

``SeqRecModel.forward`` only routes features: the item ids of histories and candidates go
through one ``EmbeddingCollection`` table (sequence embeddings), the hashed user id through an
``EmbeddingBagCollection`` (pooled), the side features (``model.side_features``) through one
``EmbeddingBagCollection`` of user tables and one of item tables (``freescale.model.side``), and
everything dense, whose shapes depend on the data, sits in ``SeqRecTask``. TorchRec's pipelines
FX-trace the top-level forward to find the sharded modules' inputs and treat ``SeqRecTask`` as
one leaf, so it may branch on the data.

``SeqRecTask``: positional embeddings on the UIH, a pre-norm transformer encoder over the
jagged UIH, candidate-target attention (each candidate attends over its own sample's encoded
history), an MLP head on [candidate, attended, candidate * attended, user], and BCE loss. It
takes the rows as plain tensors and the batch's shape (history lengths, candidate counts) as
host tensors: every index it needs (the attention's groups, the positions, which candidates
belong to which user) is computed on the host and copied to the device without waiting, so a
forward never makes the host wait for the device. It needs torch alone; TorchRec is imported
where the embedding modules are built.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from freescale.config import reads_user_row
from freescale.data.features import CANDIDATE_FEATURE, UIH_FEATURE, USER_FEATURE
from freescale.device import to_device
from freescale.model.flops import seqrec_flops
from freescale.model.jagged_attention import JaggedLayout, offsets_of
from freescale.model.output import StepOutput
from freescale.model.side import SideFeaturesTask, SideJoin, SideSpec

__all__ = ["ITEM_TABLE", "USER_TABLE", "SeqRecModel", "SeqRecTask", "StepOutput", "build_task", "task_settings"]

if TYPE_CHECKING:
    from freescale.config import EmbeddingConfig as EmbeddingSettings
    from freescale.config import ExperimentConfig, ModelConfig, TaskConfig
    from freescale.data.batch import Batch

ITEM_TABLE = "item_table"
USER_TABLE = "user_table"


class EncoderLayer(nn.Module):
    def __init__(self, dim: int, num_heads: int, ffn_mult: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_mult * dim), nn.GELU(), nn.Linear(ffn_mult * dim, dim))

    def forward(self, x: torch.Tensor, layout: JaggedLayout) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.proj(layout.attend(q, k, v, self.num_heads))
        return x + self.ffn(self.norm2(x))


class SeqRecTask(nn.Module):
    """Dense part: encoder, target attention, head and loss (one FX leaf)."""

    def __init__(self, cfg: ModelConfig, max_uih_len: int, num_labels: int = 1) -> None:
        super().__init__()
        dim = cfg.d_model or cfg.embedding_dim
        self.cfg = cfg
        # Wide embedding rows projected down to the model's width (as production sequence models do).
        self.project = nn.Linear(cfg.embedding_dim, dim) if dim != cfg.embedding_dim else None
        self.positions = nn.Embedding(max_uih_len, dim)
        self.layers = nn.ModuleList(EncoderLayer(dim, cfg.num_heads, cfg.ffn_mult) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(dim)
        self.target_q = nn.Linear(dim, dim)
        self.target_kv = nn.Linear(dim, 2 * dim)
        widths = [4 * dim if reads_user_row(cfg) else 3 * dim, *cfg.mlp_dims]
        mlp: list[nn.Module] = []
        for a, b in zip(widths, widths[1:]):
            mlp += [nn.Linear(a, b), nn.ReLU()]
        self.head = nn.Sequential(*mlp, nn.Linear(widths[-1], num_labels))  # one logit per label
        nn.init.normal_(self.positions.weight, std=0.02)

    def flops(self, uih_lengths, cand_counts) -> float:
        """Forward FLOPs on samples with these host lengths (``freescale.model.flops``)."""
        return seqrec_flops(self.cfg, uih_lengths, cand_counts)

    def forward(
        self,
        uih: torch.Tensor,
        cand: torch.Tensor,
        user_rows: torch.Tensor | None,
        item_ids: torch.Tensor,
        uih_lengths: torch.Tensor,
        cand_counts: torch.Tensor,
        uih_timestamps: torch.Tensor,
        cand_timestamps: torch.Tensor,
        labels: torch.Tensor,
        sample_ids: torch.Tensor,
        batch_index: torch.Tensor,
        loss_scale: torch.Tensor,
        stream_positions: torch.Tensor | None = None,
    ):
        """(loss, StepOutput) of the histories' rows ``uih`` [sum(uih_lengths), D], the candidates'
        ``cand`` [sum(cand_counts), D] and the users' ``user_rows`` [samples, D] (None without a
        user row: ``config.reads_user_row``), on the model's device, and ``labels``
        [sum(cand_counts), K]; ``uih_lengths``, ``cand_counts`` (and the ``sample_ids`` and
        ``batch_index`` passed through) are host tensors.
        Every task takes the same arguments (``TASK_ARGUMENTS``); this one has no use for the item
        ids or the timestamps."""
        device = uih.device
        if self.project is not None:
            uih, cand = self.project(uih), self.project(cand)
            user_rows = self.project(user_rows) if user_rows is not None else None
        self_layout = JaggedLayout(uih_lengths, uih_lengths, self.cfg.attention_padding, device)
        target_layout = JaggedLayout(uih_lengths, cand_counts, self.cfg.attention_padding, device)

        # Position counted from the most recent event, so truncation keeps positions stable.
        within = torch.arange(int(uih_lengths.sum())) - torch.repeat_interleave(offsets_of(uih_lengths)[:-1], uih_lengths)
        from_end = torch.repeat_interleave(uih_lengths, uih_lengths) - 1 - within
        x = uih + self.positions(to_device(from_end.clamp_(max=self.positions.num_embeddings - 1), device))
        for layer in self.layers:
            x = layer(x, self_layout)
        x = self.norm(x)

        k, v = self.target_kv(x).chunk(2, dim=-1)
        attended = target_layout.attend(self.target_q(cand), k, v, self.cfg.num_heads)
        features = [cand, attended, cand * attended]
        if user_rows is not None:  # each sample's user row once per candidate
            owner = torch.repeat_interleave(torch.arange(len(cand_counts)), cand_counts)
            features.append(user_rows.index_select(0, to_device(owner, device)))
        logits = self.head(torch.cat(features, dim=-1))
        loss = F.binary_cross_entropy_with_logits(logits, labels) * loss_scale
        return loss, StepOutput(loss.detach(), logits.detach(), labels, sample_ids, uih_lengths, batch_index,
                                cand_counts)


class SeqRecModel(nn.Module):
    """Routes a ``Batch`` through the embedding modules into ``SeqRecTask``.

    Returns ``(loss, StepOutput)`` as TorchRec's pipelines expect ``(losses, output)``.
    """

    def __init__(self, cfg: ModelConfig, emb: EmbeddingSettings, *, num_items: int, max_uih_len: int,
                 device: torch.device, task_cfg: TaskConfig | None = None, num_labels: int = 1,
                 max_candidates: int = 1, seed: int = 0, side_specs: list[SideSpec] = ()) -> None:
        from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
        from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

        super().__init__()
        init = partial(nn.init.normal_, mean=0.0, std=emb.init_std)
        self.item_ec = EmbeddingCollection(
            tables=[EmbeddingConfig(name=ITEM_TABLE, embedding_dim=cfg.embedding_dim, num_embeddings=num_items,
                                    feature_names=[UIH_FEATURE, CANDIDATE_FEATURE], init_fn=init)],
            device=device,
        )
        self.user_ebc = (
            EmbeddingBagCollection(
                tables=[EmbeddingBagConfig(name=USER_TABLE, embedding_dim=cfg.embedding_dim, num_embeddings=cfg.user_hash_size,
                                           feature_names=[USER_FEATURE], pooling=PoolingType.SUM, init_fn=init)],
                device=device,
            )
            if cfg.user_features
            else None
        )

        def side_tables(specs: list[SideSpec]):
            """An EmbeddingBagCollection of a table per side feature (None for none)."""
            pooling = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}
            return EmbeddingBagCollection(
                tables=[EmbeddingBagConfig(name=s.table, embedding_dim=s.dim, num_embeddings=s.rows,
                                           feature_names=[s.key], pooling=pooling[s.pooling], init_fn=init)
                        for s in specs],
                device=device,
            ) if specs else None

        self.user_side_ebc = side_tables([s for s in side_specs if s.user])
        self.item_side_ebc = side_tables([s for s in side_specs if not s.user])
        self.side_specs = list(side_specs)
        self.task = build_task(cfg, max_uih_len=max_uih_len, task_cfg=task_cfg, num_labels=num_labels,
                               max_candidates=max_candidates, seed=seed, side_specs=side_specs)

    def forward(self, batch: Batch):
        seq = self.item_ec(batch.seq_features)
        user = self.user_ebc(batch.user_features)[USER_FEATURE] if self.user_ebc is not None else None
        rows = (seq[UIH_FEATURE].values(), seq[CANDIDATE_FEATURE].values(), user)
        if not self.side_specs:
            return self.task(*rows, *task_arguments(batch))
        # The side rows as {key: pooled rows} (the item features' a bag per history event, then per candidate).
        user_side = self.user_side_ebc(batch.user_side_features).to_dict() if self.user_side_ebc is not None else {}
        item_side = self.item_side_ebc(batch.item_side_features).to_dict() if self.item_side_ebc is not None else {}
        return self.task(*rows, user_side, item_side, *task_arguments(batch))


TASK_ARGUMENTS = ("item_ids", "uih_lengths", "cand_counts", "uih_timestamps", "cand_timestamps", "labels",
                  "sample_ids", "batch_index", "loss_scale", "stream_positions")
"""The batch fields every task takes after the rows (histories', candidates', users')."""


def task_arguments(batch: Batch) -> tuple:
    return tuple(getattr(batch, name) for name in TASK_ARGUMENTS)


def build_task(cfg: ModelConfig, *, max_uih_len: int, task_cfg: TaskConfig | None = None, num_labels: int = 1,
               max_candidates: int = 1, seed: int = 0, side_specs: list[SideSpec] = ()) -> nn.Module:
    """The dense task ``model.kind`` and ``task.kind`` name (ranking with the transformer or HSTU,
    retrieval with HSTU); ``max_candidates``: the most candidates a sample has (HSTU's ranking
    appends them to the history, so its maximum sequence is ``max_uih_len + max_candidates``).
    With side features (``side_specs``) the task joins their rows first (``SideFeaturesTask``)."""
    task = _dense_task(cfg, max_uih_len=max_uih_len, task_cfg=task_cfg, num_labels=num_labels,
                       max_candidates=max_candidates, seed=seed)
    return SideFeaturesTask(task, SideJoin(list(side_specs), cfg.embedding_dim)) if side_specs else task


def _dense_task(cfg: ModelConfig, *, max_uih_len: int, task_cfg: TaskConfig | None, num_labels: int,
                max_candidates: int, seed: int) -> nn.Module:
    kind = task_cfg.kind if task_cfg is not None else "ranking"
    if cfg.kind == "transformer":
        if kind != "ranking":
            raise ValueError(f"task.kind {kind} needs model.kind hstu")
        return SeqRecTask(cfg, max_uih_len, num_labels)
    from freescale.config import TaskConfig
    from freescale.model.hstu_tasks import HSTURankingTask, HSTURetrievalTask

    if kind == "retrieval":
        return HSTURetrievalTask(cfg, task_cfg or TaskConfig(kind="retrieval"), max_len=max_uih_len, seed=seed)
    return HSTURankingTask(cfg, max_len=max_uih_len + max_candidates, num_labels=num_labels, seed=seed)


def task_settings(cfg: ExperimentConfig) -> dict:
    """``SeqRecModel``'s task keywords from an experiment: its maximum history, task, labels and
    candidates per sample."""
    from freescale.data.features import label_names

    candidates = 1 + cfg.task.num_negatives if cfg.task.kind == "retrieval" else cfg.data.num_candidates
    return dict(max_uih_len=cfg.data.max_uih_len, task_cfg=cfg.task, num_labels=len(label_names(cfg.data, cfg.task.kind)),
                max_candidates=candidates, seed=cfg.run.seed)
