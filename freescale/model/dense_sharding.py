"""How the dense part (the task) is held by the ranks of a replica group: ``dense.sharding``.

- ``replicate`` (``Replicate``): every rank holds the whole task and its optimizer state; after
  backward the gradients are averaged over the group in one flat all-reduce
  (``DenseReduction``), which the pipeline starts as soon as backward ends and waits for before
  the optimizer steps.
- ``fsdp`` (``FullyShard``): FSDP2's ``fully_shard`` over the group's ranks, per block (each
  child of every ``nn.ModuleList``: the transformer's or HSTU's layers, the per-label heads),
  then the task itself, as torchtitan shards its blocks. Each parameter is a DTensor sharded
  on dim 0; a block's parameters are all-gathered before its forward (and again before its
  backward) and freed after; backward reduce-scatters the block's gradients, averaged over the
  group, so each rank ends the backward holding its shard's mean gradient. Nothing is left to
  reduce after backward (``ShardedReduction`` waits for nothing), and the optimizer, built over
  the sharded parameters, keeps state for its shard alone: a rank holds 1/N of the parameters
  and of the optimizer state.

Both give every rank the group's mean gradient of what it holds; the sums run in a different
order (one all-reduce against a reduce-scatter per block), so the two agree up to float
rounding, not bit for bit. Each is deterministic: ``sync`` and ``prioritized`` train alike, bit
for bit, under either.

FSDP's collectives run on a group of their own over the replica group's ranks, so they never
interleave with the trainer's other collectives on the replica's group.

Checkpoints hold the sharded parameters and optimizer state as DTensors (DCP saves each rank's
shard and loads them back in place, or whole where a reader wants full tensors: ``freescale
export`` loads them so). Under the replica layer (``freescale.ft.replica``) the gradients
crossing between groups are each rank's shard (``local_gradients``: rank r of every group holds
the same shard, the groups' meshes being alike), and a catch-up hands rank r the same-rank peer's
shards (``freescale.ft.catchup``).

One sharding is chosen at build time (``DENSE_SHARDINGS``); the pipelines ask it for the step's
reduction and never which sharding they run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor


class DenseReduction:
    """The dense gradients averaged over the group: one flat all-reduce (the same on every
    rank), started at once; ``wait`` puts the averages in the gradients."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup) -> None:
        self.params = params
        self.grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        self.flat = torch.cat([g.reshape(-1) for g in self.grads])
        self.world_size = dist.get_world_size(group)
        self.work = dist.all_reduce(self.flat, group=group, async_op=True)

    def wait(self) -> None:
        self.work.wait()
        self.flat /= self.world_size
        at = 0
        for p, g in zip(self.params, self.grads):
            n = g.numel()
            p.grad = self.flat[at:at + n].view_as(g).clone()
            at += n


class ShardedReduction:
    """FSDP averaged the gradients over the group during backward (reduce-scatter): nothing to
    wait for. A parameter no block used in the step gets a zero gradient, as under
    ``DenseReduction``, so every rank's optimizer steps the same parameters."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup) -> None:
        self.params = params

    def wait(self) -> None:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)


class Replicate:
    """``dense.sharding: replicate``: the whole task on every rank."""

    name = "replicate"
    reduction = DenseReduction

    def shard(self, task: nn.Module, group: dist.ProcessGroup) -> nn.Module:
        return task


class FullyShard:
    """``dense.sharding: fsdp``: the task ``fully_shard``ed over the group's ranks, per block."""

    name = "fsdp"
    reduction = ShardedReduction

    def shard(self, task: nn.Module, group: dist.ProcessGroup) -> nn.Module:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        from freescale.distributed import new_group_like

        device = next(task.parameters()).device
        mesh = DeviceMesh.from_group(new_group_like(group, backend="same"), device.type)
        for block in blocks(task):
            fully_shard(block, mesh=mesh)
        fully_shard(task, mesh=mesh)
        return task


def blocks(task: nn.Module) -> list[nn.Module]:
    """The units FSDP shards one by one: the children of every ``nn.ModuleList`` in ``task``."""
    return [child for module in task.modules() if isinstance(module, nn.ModuleList) for child in module]


def local_gradients(params: list[nn.Parameter]) -> list[torch.Tensor]:
    """Each parameter's gradient as this rank holds it (a zero one made where there is none): a
    sharded gradient's local shard, a replicated one whole. Writing into them writes the gradients."""
    out = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        out.append(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
    return out


DENSE_SHARDINGS = {"replicate": Replicate(), "fsdp": FullyShard()}
"""The shardings of the dense part, by ``dense.sharding``."""
