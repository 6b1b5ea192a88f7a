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
from torch.distributed.remote_device import _remote_device
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner import Topology as PlannerTopology
from torchrec.distributed.types import ShardingEnv, ShardingPlan, ShardingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from freescale.config import EmbeddingConfig, TrainConfig
from freescale.distributed import Topology, broadcast_object
from freescale.model.seqrec import ITEM_TABLE, USER_TABLE

SHARDING_TYPES = {"row_wise": ShardingType.ROW_WISE, "table_wise": ShardingType.TABLE_WISE}
EMBEDDING_OPTIMIZERS = {"rowwise_adagrad": RowWiseAdagrad, "sgd": torch.optim.SGD}
DENSE_OPTIMIZERS = {"adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}


def shard_model(model: nn.Module, cfg: EmbeddingConfig, topology: Topology, device: torch.device, *,
                pec: bool = False) -> DistributedModelParallel:
    """Fuse the embedding optimizer, plan the sharding on the replica's rank 0 (every rank gets
    its plan) and wrap in DMP over the replica's group. ``pec``: the item table's collection is
    wrapped in TorchRec's ``PECEmbeddingCollection`` and sharded by its sharder (row-wise)."""
    pg = topology.pg
    tables = [getattr(model, name, None) for name in ("item_ec", "user_ebc", "user_side_ebc", "item_side_ebc")]
    for module in (m for m in tables if m is not None):
        apply_optimizer_in_backward(EMBEDDING_OPTIMIZERS[cfg.optimizer], module.parameters(), {"lr": cfg.lr})
    item_sharder = EmbeddingCollectionSharder()
    if pec:
        from torchrec.distributed.pec_embedding import PECEmbeddingCollectionSharder
        from torchrec.modules.pec_embedding_modules import PECEmbeddingCollection

        model.item_ec = PECEmbeddingCollection(model.item_ec)
        item_sharder = PECEmbeddingCollectionSharder()
    sharders = [item_sharder, EmbeddingBagCollectionSharder()]
    constraints = None
    if cfg.sharding != "auto":
        # Pooled tables (the user's, the side features') shard row-wise only on accelerators in
        # TorchRec. Column-wise gives every rank a slice, so all ranks take part in the same
        # collectives in the same order.
        pooled = [USER_TABLE, *(s.table for s in getattr(model, "side_specs", ()))]
        constraints = {
            ITEM_TABLE: ParameterConstraints(sharding_types=[SHARDING_TYPES[cfg.sharding].value]),
            **{name: ParameterConstraints(sharding_types=[ShardingType.COLUMN_WISE.value]) for name in pooled},
        }
    planner = EmbeddingShardingPlanner(
        topology=PlannerTopology(world_size=topology.world_size, compute_device=device.type,
                                 local_world_size=topology.local_world_size),
        constraints=constraints,
    )
    # TorchRec's collective_plan broadcasts from global rank 0, which a replica other than the
    # first does not hold; plan on the replica's rank 0 and broadcast within the replica.
    plan = broadcast_object(planner.plan(model, sharders) if topology.is_main else None, pg)
    _place_on_global_ranks(plan, pg)
    return DistributedModelParallel(model, env=ShardingEnv.from_process_group(pg), device=device, plan=plan,
                                    sharders=sharders)


def _place_on_global_ranks(plan: ShardingPlan, pg) -> None:
    """Name each shard's placement by its global rank, as torch's ShardedTensor reads it.

    The planner numbers ranks within the replica (0 .. ranks-1), which are the global ranks
    only in the first replica; the sharding itself stays in replica ranks (``param_sharding.ranks``,
    compared with the replica's ``ShardingEnv``).
    """
    global_rank = dist.get_process_group_ranks(pg)
    for module_plan in plan.plan.values():
        for param_sharding in module_plan.values():
            spec = param_sharding.sharding_spec
            for shard in getattr(spec, "shards", None) or []:
                device = shard.placement.device()
                shard.placement = _remote_device(f"rank:{global_rank[shard.placement.rank()]}/{device}")


def build_optimizer(model: DistributedModelParallel, cfg: TrainConfig) -> CombinedOptimizer:
    """The fused embedding optimizer plus the dense optimizer over every other parameter."""
    dense_cls = DENSE_OPTIMIZERS[cfg.optimizer]
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: dense_cls(params, lr=cfg.lr, weight_decay=cfg.weight_decay),
    )
    return CombinedOptimizer([model.fused_optimizer, dense])


def dense_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters no fused embedding optimizer updates, in module order."""
    return [p for _, p in in_backward_optimizer_filter(model.named_parameters()) if p.requires_grad]


def dense_part(optimizer: CombinedOptimizer) -> KeyedOptimizerWrapper:
    """The dense optimizer inside ``build_optimizer``'s combined one."""
    for _, opt in optimizer.optimizers:
        if isinstance(opt, KeyedOptimizerWrapper):
            return opt
    raise ValueError("the optimizer holds no dense part")


def build_dense_optimizer(module: nn.Module, cfg: TrainConfig) -> CombinedOptimizer:
    """The dense optimizer over ``module``'s parameters alone (the embedding tables fuse their own)."""
    dense_cls = DENSE_OPTIMIZERS[cfg.optimizer]
    dense = KeyedOptimizerWrapper(dict(module.named_parameters()),
                                  lambda params: dense_cls(params, lr=cfg.lr, weight_decay=cfg.weight_decay))
    return CombinedOptimizer([dense])


def init_dense_state(optimizer: CombinedOptimizer) -> None:
    """Materialize the dense optimizer's lazy state so a checkpoint can be loaded into it."""
    for _, opt in optimizer.optimizers:
        if isinstance(opt, KeyedOptimizerWrapper):
            opt.init_state()
