"""The two kinds of embedding tables a run trains, and what follows from each kind.

- TorchRec's (``TORCHREC_TABLES``, under the ``sparse_dist`` and ``base`` pipelines):
  ``SeqRecModel`` built on the meta device, its tables sharded and materialized by DMP with
  the optimizer fused into backward; the optimizer combines the fused one with the dense one;
  under the replica layer the groups add up their changes to the rows every
  ``ft.embedding_sync_every`` steps (``TableSync``).
- TorchRec's with the item table in PEC's modules (``PEC_TABLES``, under ``pec``): the same,
  the item table's collection wrapped in ``PECEmbeddingCollection``.
- FreeScale's own (``OWNED_TABLES``, under ``sync`` and ``prioritized``): ``OwnedModel`` over
  ``ShardedTables``, on the run's device (fbgemm's CPU or CUDA kernel); the optimizer is the dense one alone, over the model's
  task (the tables fuse their own); under the replica layer each step's row gradients are
  summed across the groups (``OwnedRows``).

Each pipeline class names its kind (``table_kind``), so the trainer never asks which it has.
Each kind also copies out this rank's part of its tables and of their fused optimizer's state
(``embedding_state``), which ``freescale verify`` compares between two runs.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

from freescale.config import ConfigError, ExperimentConfig, TrainConfig
from freescale.data.batch import SideLayout
from freescale.distributed import Topology
from freescale.embedding.pipeline import build_owned_model
from freescale.embedding.replicated import OwnedRows
from freescale.ft.rows import FusedTables
from freescale.ft.table_sync import TableSync
from freescale.model.seqrec import SeqRecModel, task_settings
from freescale.model.side import side_specs
from freescale.model.sharding import build_dense_optimizer, build_optimizer, dense_part, shard_model


EmbeddingState = dict[str, dict[str, torch.Tensor]]
"""Copies of this rank's embedding rows and of their optimizer's state: ``{"embedding rows":
{name: rows}, "embedding optimizer state": {name: state}}``."""


def local_copies(name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """This rank's part of ``value`` by name, copied: a ShardedTensor's local shards (named by
    their offsets when a rank holds several), a DTensor's local tensor, a plain tensor whole."""
    if isinstance(value, ShardedTensor):
        shards = value.local_shards()
        if len(shards) == 1:
            return {name: shards[0].tensor.detach().clone()}
        return {f"{name}@{tuple(s.metadata.shard_offsets)}": s.tensor.detach().clone() for s in shards}
    if isinstance(value, DTensor):
        value = value.to_local()
    return {name: value.detach().clone()}


class TorchRecTables:
    """TorchRec's EmbeddingCollection tables, sharded by DistributedModelParallel."""

    description = "TorchRec's tables"

    def check_device(self, pipeline: str, device: torch.device) -> None:
        """They run wherever TorchRec does."""

    def build_model(self, cfg: ExperimentConfig, *, num_items: int, topology: Topology,
                    device: torch.device, side_layout: SideLayout = SideLayout()) -> nn.Module:
        model = SeqRecModel(cfg.model, cfg.embedding, num_items=num_items, **task_settings(cfg),
                            device=torch.device("meta"), side_specs=side_specs(cfg.model, side_layout))
        return shard_model(model, cfg.embedding, topology, device)

    def build_optimizer(self, model: nn.Module, cfg: TrainConfig):
        """The fused embedding optimizer and the dense one, combined."""
        return build_optimizer(model, cfg)

    def dense_module(self, model: nn.Module) -> nn.Module:
        """The module whose non-fused parameters are the dense ones (DMP's: the whole model)."""
        return model

    def task(self, model: nn.Module) -> nn.Module:
        """The task inside DMP (it counts the model's FLOPs)."""
        return model.module.task

    def dense_optimizer(self, optimizer):
        return dense_part(optimizer)

    def table_side(self, cfg: ExperimentConfig, model: nn.Module) -> TableSync:
        return TableSync(FusedTables(model), every=cfg.ft.embedding_sync_every,
                         average=cfg.ft.embedding_sync == "average", checkpoint_every=cfg.checkpoint.every,
                         last_step=cfg.train.steps)

    def embedding_state(self, model: nn.Module) -> EmbeddingState:
        """The parameters the fused optimizer updates (the tables' shards on this rank) and its
        state (row-wise Adagrad's ``momentum1``), by their names in DMP's state dict."""
        fused = model.fused_optimizer
        rows, state = {}, {}
        for name, param in fused.params.items():
            rows.update(local_copies(name, param))
        for name, per_key in fused.state_dict()["state"].items():
            for key, value in per_key.items():
                if torch.is_tensor(value):
                    state.update(local_copies(f"{name}.{key}", value))
        return {"embedding rows": rows, "embedding optimizer state": state}


class PECTables(TorchRecTables):
    """TorchRec's tables, the item table's collection wrapped in ``PECEmbeddingCollection``
    (``train.pipeline: pec``): sharded row-wise by PEC's sharder, the rest as ``sparse_dist``."""

    def build_model(self, cfg: ExperimentConfig, *, num_items: int, topology: Topology,
                    device: torch.device, side_layout: SideLayout = SideLayout()) -> nn.Module:
        model = SeqRecModel(cfg.model, cfg.embedding, num_items=num_items, **task_settings(cfg),
                            device=torch.device("meta"), side_specs=side_specs(cfg.model, side_layout))
        return shard_model(model, cfg.embedding, topology, device, pec=True)

    def embedding_state(self, model: nn.Module) -> EmbeddingState:
        """As ``sparse_dist``'s, named as there: PEC's module nests the item table's collection
        one level deeper (``item_ec._embedding_collection.embeddings...``)."""
        return {kind: {name.replace("._embedding_collection", ""): value for name, value in part.items()}
                for kind, part in super().embedding_state(model).items()}


class OwnedTables:
    """FreeScale's own row-wise sharded tables (``freescale.embedding``)."""

    description = "FreeScale's own tables"

    def check_device(self, pipeline: str, device: torch.device) -> None:
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(f"train.pipeline: {pipeline} trains FreeScale's own tables, which run on cpu or cuda "
                              f"(resolved: {device.type})")

    def build_model(self, cfg: ExperimentConfig, *, num_items: int, topology: Topology,
                    device: torch.device, side_layout: SideLayout = SideLayout()) -> nn.Module:
        return build_owned_model(cfg, num_items=num_items, max_uih_len=cfg.data.max_uih_len, topology=topology,
                                 seed=cfg.run.seed, device=device, side_layout=side_layout)

    def build_optimizer(self, model: nn.Module, cfg: TrainConfig):
        """The dense optimizer alone, over the task."""
        return build_dense_optimizer(model.task, cfg)

    def dense_module(self, model: nn.Module) -> nn.Module:
        return model.task

    def task(self, model: nn.Module) -> nn.Module:
        return model.task

    def dense_optimizer(self, optimizer):
        return optimizer

    def table_side(self, cfg: ExperimentConfig, model: nn.Module) -> OwnedRows:
        return OwnedRows(model.tables)

    def embedding_state(self, model: nn.Module) -> EmbeddingState:
        """This rank's rows (every table in one kernel) and their row-wise momentum (none for SGD)."""
        momentum = model.tables.momentum()
        return {"embedding rows": {"weight": model.tables.weight.detach().clone()},
                "embedding optimizer state": {"momentum": momentum.detach().clone()} if momentum is not None else {}}


TORCHREC_TABLES = TorchRecTables()
PEC_TABLES = PECTables()
OWNED_TABLES = OwnedTables()
