"""Row-wise sharded embedding tables whose all-to-alls FreeScale issues itself.

TorchRec's standard sequence-embedding all-to-alls call ``torch.distributed`` inside its
sharded module, one per lookup, in the order of forward and backward. TorchRec's PEC modules
(``train.pipeline: pec``, ``freescale.train.pec``) split them into overlapping and other rows
over the module's one process group; these tables go further. They keep the ecosystem's parts (TorchRec's
row-wise layout, fbgemm's table-batched kernel with ``PoolingMode.NONE`` for the local
lookup, the same fused optimizer as the baseline) and do the id, embedding and gradient
exchanges through the transport interface, so a pipeline can order them.

The tables live on the run's device: on a GPU, fbgemm's CUDA kernel over device memory
(``EmbeddingLocation.DEVICE``), on CPU its CPU kernel over host memory; every tensor this
module gives the transport is on that device (the transport stages device tensors itself).

Layout: each table's rows are cut into ``world_size`` blocks of ``ceil(rows / world_size)``
(TorchRec's row-wise sharding, the last block shorter); rank r owns block r of every table,
held in one local fbgemm table (the tables' blocks back to back). The optimizer is fused
into the kernel's backward: ``update(ids, grads)`` applies it to the rows ``ids`` (repeats
accumulate, as in one training step).

An id travels as its owner's local row (``Route``): the sender orders its ids owner-major
(stable), sends each owner its share, and keeps the order to put the rows it gets back in
its batch's order.

Routing happens on the host: a batch's ids come from the loader in host memory, and the
owners, the order, the counts and the ids each owner receives are computed and exchanged
there (host tensors, which every transport moves without staging). Only what the device
computes with (the owners' ids to look up, the orders that sort rows and gradients) is copied
to it, without waiting; a count never has to be read back from the device.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    EmbeddingLocation,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.device_mesh import DeviceMesh

from freescale.device import to_device
from freescale.ft.rows import kernel_blocks
from freescale.transport.base import NORMAL

FUSED_OPTIMIZERS = {"rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "sgd": EmbOptimType.EXACT_SGD}
EPS = 1e-8  # fbgemm's default, what TorchRec's fused row-wise Adagrad passes it too
INIT_CHUNK = 1 << 16  # rows drawn from one seed at initialization


class Route(NamedTuple):
    """One batch's ids as the exchange moved them: host tensors, and the device's copies of what
    the device computes with."""

    order: torch.Tensor
    """Positions of the batch's ids, owner-major: ``ids_in_batch[order]`` is what was sent."""
    owners: torch.Tensor
    """Owner of each id, owner-major (ascending)."""
    send_counts: list[int]
    """Ids this rank sent each owner."""
    recv_counts: list[int]
    """Ids this rank received from each rank (as their owner)."""
    ids: torch.Tensor
    """Local rows this rank owns that the senders asked for, shard-major (by sender, then in its order)."""
    device_ids: torch.Tensor
    """``ids`` on the tables' device (what lookups and updates take)."""
    device_order: torch.Tensor
    """``order`` on the tables' device."""
    device_back: torch.Tensor
    """The inverse of ``order`` on the tables' device: owner-major rows back in the batch's order."""

    def to_owner(self, rows_in_batch: torch.Tensor) -> torch.Tensor:
        """Rows in the batch's order, owner-major (as the ids were sent)."""
        return rows_in_batch.index_select(0, self.device_order)

    def to_batch(self, rows_owner_major: torch.Tensor) -> torch.Tensor:
        """Rows in owner-major order back in the batch's order (a gather: faster than a scatter)."""
        return rows_owner_major.index_select(0, self.device_back)


def placement(device: torch.device) -> tuple[EmbeddingLocation, ComputeDevice]:
    """Where fbgemm keeps a table on ``device`` and where it computes: host memory and the CPU
    kernels, or the GPU's memory and its kernels."""
    if device.type == "cuda":
        return EmbeddingLocation.DEVICE, ComputeDevice.CUDA
    if device.type == "cpu":
        return EmbeddingLocation.HOST, ComputeDevice.CPU
    raise ValueError(f"FreeScale's own tables run on cpu or cuda, not {device.type}")


def counts_by(keys: torch.Tensor, world_size: int) -> list[int]:
    """How many of the (sorted or not) owner indices ``keys`` (a host tensor) fall on each rank."""
    return torch.bincount(keys, minlength=world_size).tolist()


class ShardedTables(nn.Module):
    """Row-wise sharded tables over a replica's ranks, looked up and updated through a transport."""

    def __init__(self, tables: dict[str, int], dim: int, *, rank: int, world_size: int, group: dist.ProcessGroup,
                 optimizer: str, lr: float, init_std: float, seed: int,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.device = torch.device(device)
        self.names = list(tables)
        self.rows = [tables[n] for n in self.names]
        self.dim = dim
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.blocks = [math.ceil(n / world_size) for n in self.rows]
        # Rows of each table on each rank, and where each table's block starts in a rank's local table.
        self.local_rows = [[max(0, min(n, (r + 1) * b) - r * b) for n, b in zip(self.rows, self.blocks)]
                           for r in range(world_size)]
        # [world, tables], on the host (routing happens there)
        self.local_starts = torch.tensor([[sum(per_rank[:t]) for t in range(len(self.rows))] for per_rank in self.local_rows],
                                         dtype=torch.int64)
        local_total = max(1, sum(self.local_rows[rank]))  # fbgemm wants a row; an empty shard is never read
        self.kernel = SplitTableBatchedEmbeddingBagsCodegen(
            [(local_total, dim, *placement(self.device))],
            optimizer=FUSED_OPTIMIZERS[optimizer], learning_rate=lr, eps=EPS,
            pooling_mode=PoolingMode.NONE, weights_precision=SparseType.FP32, device=self.device,
        )
        self._init_rows(init_std, seed)

    # Layout --------------------------------------------------------------------------------

    def _init_rows(self, std: float, seed: int) -> None:
        """Normal(0, std) rows, drawn in fixed chunks of ``INIT_CHUNK`` rows seeded by (seed, table,
        chunk): any world size sees the same value for the same global row, and a rank draws
        only the chunks its block overlaps."""
        weight = self.weight
        with torch.no_grad():
            for t, b in enumerate(self.blocks):
                start, count = self.rank * b, self.local_rows[self.rank][t]
                at = int(self.local_starts[self.rank, t])
                for chunk in range(start // INIT_CHUNK, (start + count - 1) // INIT_CHUNK + 1 if count else 0):
                    lo, hi = chunk * INIT_CHUNK, min((chunk + 1) * INIT_CHUNK, self.rows[t])
                    gen = torch.Generator().manual_seed((seed * 1000003 + t) * 1000003 + chunk)
                    rows = torch.empty(hi - lo, self.dim).normal_(0.0, std, generator=gen)
                    a, z = max(lo, start), min(hi, start + count)
                    weight[at + a - start:at + z - start] = rows[a - lo:z - lo]

    @property
    def weight(self) -> torch.Tensor:
        """This rank's local rows [local rows, dim] (a view of the kernel's storage)."""
        return self.kernel.split_embedding_weights()[0]

    def momentum(self) -> torch.Tensor | None:
        """Row-wise Adagrad's per-row state (a view), or None for SGD."""
        states = self.kernel.split_optimizer_states()
        return states[0][0] if states and states[0] else None

    def row_block(self) -> list[torch.Tensor]:
        """This rank's rows and their optimizer state, as the replica layer saves and averages them
        (``freescale.ft.rows``)."""
        return kernel_blocks(self.kernel)[0]

    def locate(self, table: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(owner rank, owner's local row) of global rows ``ids`` (host) of table ``table``."""
        owners = torch.div(ids, self.blocks[table], rounding_mode="floor")
        return owners, ids - owners * self.blocks[table] + self.local_starts[owners, table]

    # Exchanges -----------------------------------------------------------------------------

    def route(self, transport, segments: Sequence[tuple[int, torch.Tensor]], lane: int = NORMAL) -> "PendingRoute":
        """Start sending each owner the ids it holds; ``segments`` are (table, global ids) in
        the batch's order, host tensors. The counts go first (small), then the ids."""
        located = [self.locate(t, ids) for t, ids in segments]
        none = torch.zeros(0, dtype=torch.int64)
        owners = torch.cat([o for o, _ in located]) if located else none
        local = torch.cat([lr for _, lr in located]) if located else none
        owners_sorted, order = torch.sort(owners, stable=True)
        send_counts = counts_by(owners_sorted, self.world_size)
        counts = transport.all_to_all_single(torch.tensor(send_counts, dtype=torch.int64), [1] * self.world_size,
                                             [1] * self.world_size, lane=lane)
        return PendingRoute(transport, lane, order, owners_sorted, send_counts, local[order], counts, self.device)

    def lookup(self, ids: torch.Tensor, track: bool = False) -> torch.Tensor:
        """Local rows ``ids`` (on the tables' device); with ``track``, the result's backward
        (``update_looked_up``) applies the fused optimizer to those rows without looking them up
        again. No ids: no kernel (fbgemm's CUDA kernels are not launched over nothing)."""
        if not ids.numel():
            return torch.zeros((0, self.dim), dtype=torch.float32, device=ids.device)
        offsets = torch.arange(ids.numel() + 1, dtype=torch.int64, device=ids.device)
        if track:
            with torch.enable_grad():
                return self.kernel(ids, offsets)
        with torch.no_grad():
            return self.kernel(ids, offsets)

    def update(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Apply the fused optimizer to local rows ``ids`` with ``grads`` (one row each, repeats sum)."""
        if ids.numel():
            self.update_looked_up(self.lookup(ids, track=True), grads)

    @staticmethod
    def update_looked_up(looked_up: torch.Tensor, grads: torch.Tensor) -> None:
        """Apply the fused optimizer to the rows a tracked ``lookup`` read, with ``grads`` (a
        zero row leaves its row and its optimizer state exactly as they were)."""
        if looked_up.numel():
            looked_up.backward(grads)

    # Checkpoints ---------------------------------------------------------------------------

    def _mesh(self) -> DeviceMesh:
        return DeviceMesh.from_group(self.group, device_type=self.device.type)

    def sharded_state(self) -> dict[str, torch.Tensor]:
        """Every table's weights (and optimizer state) as DTensors sharded by rows: DCP saves and
        loads them in place, across world sizes."""
        mesh = self._mesh()
        weight, momentum = self.weight, self.momentum()
        out = {}
        for t, name in enumerate(self.names):
            at, count = int(self.local_starts[self.rank, t]), self.local_rows[self.rank][t]
            out[f"{name}.weight"] = DTensor.from_local(weight[at:at + count], mesh, [Shard(0)], run_check=False,
                                                        shape=torch.Size((self.rows[t], self.dim)),
                                                        stride=(self.dim, 1))
            if momentum is not None:
                out[f"{name}.momentum"] = DTensor.from_local(momentum[at:at + count], mesh, [Shard(0)], run_check=False,
                                                              shape=torch.Size((self.rows[t],)), stride=(1,))
        return out

    def load_sharded_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copy ``state`` (as from ``sharded_state``) into the kernel, unless it already is its storage."""
        mine = self.sharded_state()
        for key, value in state.items():
            if key not in mine:
                raise KeyError(f"unexpected embedding state {key!r}; expected {sorted(mine)}")
            target = mine[key].to_local()
            source = value.to_local() if isinstance(value, DTensor) else value
            if source.data_ptr() != target.data_ptr():
                with torch.no_grad():
                    target.copy_(source)


class PendingRoute:
    """A route whose counts are on their way; ``send()`` issues the ids, ``wait()`` gives the ``Route``."""

    def __init__(self, transport, lane, order, owners, send_counts, local_sorted, counts, device) -> None:
        self.transport = transport
        self.lane = lane
        self.order = order
        self.owners = owners
        self.send_counts = send_counts
        self.local_sorted = local_sorted
        self.counts = counts
        self.device = device
        self.recv_counts: list[int] | None = None
        self.ids = None

    def send(self) -> "PendingRoute":
        if self.ids is None:
            self.recv_counts = self.counts.wait().tolist()
            self.ids = self.transport.all_to_all_single(self.local_sorted, self.send_counts, self.recv_counts,
                                                        lane=self.lane)
        return self

    def wait(self) -> Route:
        self.send()
        ids = self.ids.wait()
        return Route(self.order, self.owners, self.send_counts, self.recv_counts, ids,
                     device_ids=to_device(ids, self.device), device_order=to_device(self.order, self.device),
                     device_back=to_device(torch.argsort(self.order), self.device))
