"""Sharding the model across a replica's ranks: TorchRec's planner and DistributedModelParallel.

The embedding tables' optimizer is fused into backward (``apply_optimizer_in_backward``):
fbgemm's kernels update the rows while computing their gradients, so the tables never hold
a dense gradient. The dense layers get a regular optimizer; both are combined into one
``CombinedOptimizer`` that the pipelines step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner import Topology as PlannerTopology
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from freescale.config import EmbeddingConfig, TrainConfig
from freescale.distributed import Topology
from freescale.model.seqrec import ITEM_TABLE, USER_TABLE

_SHARDING_TYPES = {"row_wise": ShardingType.ROW_WISE, "table_wise": ShardingType.TABLE_WISE}
_EMBEDDING_OPTIMIZERS = {"rowwise_adagrad": RowWiseAdagrad, "sgd": torch.optim.SGD}
_DENSE_OPTIMIZERS = {"adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}


def shard_model(model: nn.Module, cfg: EmbeddingConfig, topology: Topology, device: torch.device,
                pg: dist.ProcessGroup | None = None) -> DistributedModelParallel:
    """Fuse the embedding optimizer, plan the sharding collectively and wrap in DMP."""
    pg = pg or dist.group.WORLD
    for module in (m for m in (getattr(model, "item_ec", None), getattr(model, "user_ebc", None)) if m is not None):
        apply_optimizer_in_backward(_EMBEDDING_OPTIMIZERS[cfg.optimizer], module.parameters(), {"lr": cfg.lr})
    sharders = [EmbeddingCollectionSharder(), EmbeddingBagCollectionSharder()]
    constraints = None
    if cfg.sharding != "auto":
        # Pooled tables shard row-wise only on accelerators in TorchRec. Column-wise gives every
        # rank a slice, so all ranks take part in the same collectives in the same order.
        constraints = {
            ITEM_TABLE: ParameterConstraints(sharding_types=[_SHARDING_TYPES[cfg.sharding].value]),
            USER_TABLE: ParameterConstraints(sharding_types=[ShardingType.COLUMN_WISE.value]),
        }
    planner = EmbeddingShardingPlanner(
        topology=PlannerTopology(world_size=topology.world_size, compute_device=device.type,
                                 local_world_size=topology.local_world_size),
        constraints=constraints,
    )
    plan = planner.collective_plan(model, sharders, pg)
    return DistributedModelParallel(model, env=ShardingEnv.from_process_group(pg), device=device, plan=plan,
                                    sharders=sharders)


def build_optimizer(model: DistributedModelParallel, cfg: TrainConfig) -> CombinedOptimizer:
    """The fused embedding optimizer plus the dense optimizer over every other parameter."""
    dense_cls = _DENSE_OPTIMIZERS[cfg.optimizer]
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: dense_cls(params, lr=cfg.lr, weight_decay=cfg.weight_decay),
    )
    return CombinedOptimizer([model.fused_optimizer, dense])


def init_dense_state(optimizer: CombinedOptimizer) -> None:
    """Materialize the dense optimizer's lazy state so a checkpoint can be loaded into it."""
    for _, opt in optimizer.optimizers:
        if isinstance(opt, KeyedOptimizerWrapper):
            opt.init_state()
