"""The replica layer: each torchrun job is one replica group, a fault domain of its own.

Every rank holds one torchft ``Manager``; the managers of rank ``g`` of every replica group
share a torchft process group, and a lighthouse (``freescale lighthouse``) forms the quorum of
the groups that are alive. One step under the layer (``train.pipeline: sync``):

1. ``begin``: the quorum for the step starts in torchft's thread (a group that is behind, or
   new, fetches a healthy peer's state meanwhile: *catch-up*, while the peers keep stepping);
2. forward and backward inside the replica, as without the layer;
3. ``before_update``: the embedding rows the step will write (weights and optimizer state)
   are saved, then the fused optimizer updates them;
4. ``reduce_dense``: the dense gradients, already averaged over the replica's ranks, are
   averaged over the participating replica groups (``Manager.allreduce``; a group that is
   catching up contributes zeros);
5. ``sync_embeddings`` (every ``ft.embedding_sync_every`` steps and at the last): every
   table's rows and optimizer state averaged across the groups, into a copy;
6. ``vote``: torchft's commit vote. Committed: the dense optimizer steps and the averaged rows
   are put in place. Failed (a peer died mid-step, an error, an injected failure): the saved
   rows go back, the dense gradients are dropped, and the same batch is trained again, so the
   failed attempt leaves no trace.

A group catching up loads the peer's state when the vote is taken: dense weights and
optimizer, its own embedding shard from the peer's same-rank shard, the step counter and the
RNG. Its data cursor is its own (each group trains its own shard of the stream, and its cursor
is saved atomically at every committed step: ``ReplicaFiles``), so its batch of that step was
not trained and is trained next.

Off (``ft.enable: false``) the trainer holds a ``NullReplica``: every step commits and trains.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from freescale.faults import InjectedFault
from freescale.io import write_json_atomic

log = logging.getLogger("freescale")

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
CURSOR_FILE = "ft_cursor.json"
COMMITS_FILE = "ft_commits.jsonl"


@dataclass(frozen=True)
class Vote:
    """How a step ended: ``stepped``, the model took the step (its counter advances);
    ``trained``, this group's batch is in it (its cursor and ledger advance); ``rewritten``,
    the layer wrote table rows itself (the averaged rows of a sync, rolled-back rows, a peer's
    state): rows read before the vote are stale."""

    stepped: bool
    trained: bool
    rewritten: bool = False


COMMITTED = Vote(stepped=True, trained=True)


class NullReplica:
    """No replica layer: one group, every step commits."""

    enabled = False

    def begin(self) -> None:
        pass

    def before_update(self, touched) -> None:
        pass

    def reduce_dense(self, flat: torch.Tensor) -> None:
        pass

    def sync_embeddings(self, blocks) -> None:
        pass

    def vote(self) -> Vote:
        return COMMITTED

    def committed(self, step: int, next_batch: int, trained: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


class ReplicaFiles:
    """A group's files in its run folder: the cursor of its data shard (rewritten atomically
    at every committed step) and one line per commit (what ``freescale local`` measures stalls
    from)."""

    def __init__(self, run_dir: str) -> None:
        self.cursor_path = os.path.join(run_dir, CURSOR_FILE)
        self.commits_path = os.path.join(run_dir, COMMITS_FILE)

    def read_cursor(self) -> dict | None:
        """``{"step", "next_batch", "time"}`` of the last committed step, or None for a new group."""
        if not os.path.exists(self.cursor_path):
            return None
        try:
            with open(self.cursor_path) as f:
                cursor = json.load(f)
            return {"step": int(cursor["step"]), "next_batch": int(cursor["next_batch"])}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{self.cursor_path}: unreadable data cursor ({e})") from e

    def write(self, step: int, next_batch: int, trained: bool) -> None:
        now = time.time()
        with open(self.commits_path, "a") as f:
            f.write(json.dumps({"step": step, "next_batch": next_batch, "trained": trained, "time": now}) + "\n")
        write_json_atomic(self.cursor_path, {"step": step, "next_batch": next_batch, "time": now})


def transfer_state(state: dict) -> dict:
    """A copy of ``state`` that the live state can no longer change: tensors cloned, sharded
    tensors as their local shards (a rank catching up takes the same-rank peer's shards)."""

    def copy(value):
        if isinstance(value, DTensor):
            return value.to_local().detach().clone()
        if isinstance(value, ShardedTensor):
            return [s.tensor.detach().clone() for s in value.local_shards()]
        if isinstance(value, torch.Tensor):
            return value.detach().clone()
        return value

    return tree_map(copy, state, is_leaf=lambda v: isinstance(v, ShardedTensor))


def load_into(live, value):
    """``value`` (a ``transfer_state`` copy) written into ``live`` (what a part's ``state_dict()``
    returns) in place: tensors, DTensors and ShardedTensors keep their storage (the tables'
    kernels, the parameters) and take the values; anything else is taken as it comes.
    Returns ``live`` for the part's ``load_state_dict``."""
    if isinstance(live, DTensor):
        live.to_local().copy_(value)
    elif isinstance(live, ShardedTensor):
        shards = live.local_shards()
        if len(shards) != len(value):
            raise ValueError(f"a peer's state holds {len(value)} local shard(s) where this rank holds {len(shards)}")
        for shard, v in zip(shards, value):
            shard.tensor.copy_(v)
    elif isinstance(live, torch.Tensor) and isinstance(value, torch.Tensor) and live.shape == value.shape:
        live.copy_(value)
    elif isinstance(live, dict) and isinstance(value, dict):
        for key, v in value.items():
            live[key] = load_into(live[key], v) if key in live else v
    elif isinstance(live, list) and isinstance(value, list) and len(live) == len(value):
        live[:] = [load_into(a, b) for a, b in zip(live, value)]
    else:
        return value
    return live


def load_transferred(state, transferred: dict) -> None:
    """A peer's ``transfer_state`` copy loaded into ``state`` (a ``TrainingState``), in place;
    the parts it does not hold (the data cursor) are left as they are."""
    state.prepare_load()
    with torch.no_grad():
        for name, part in state.parts.items():
            if name in transferred:
                part.load_state_dict(load_into(part.state_dict(), transferred[name]))


class ReplicaLayer:
    """One rank's part of the replica layer (see the module docstring)."""

    enabled = True

    def __init__(self, cfg, topo, state, dense_params: list, optimizer, faults, files: ReplicaFiles) -> None:
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's managers log every quorum and vote at info
        from torchft import Manager, ProcessGroupGloo

        ft = cfg.ft
        self.cfg = ft
        self.last_step = cfg.train.steps
        self.state = state
        self.dense_params = dense_params
        self.optimizer = optimizer
        self.faults = faults
        self.files = files
        self.rank = topo.rank
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self._saved = None
        self._synced = None
        self._step = 1
        self._failed: set[int] = set()
        timeout = timedelta(seconds=ft.timeout_s)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=self._load,
            state_dict=self._snapshot,
            min_replica_size=ft.min_replicas,
            use_async_quorum=True,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=ft.quorum_timeout_s),
            connect_timeout=timeout,
            rank=topo.rank,
            world_size=topo.world_size,
            lighthouse_addr=os.environ.get(LIGHTHOUSE_ENV) or ft.lighthouse,
            replica_id=f"replica{ft.replica_id}",
            init_sync=False,  # every group draws the same initial weights from run.seed
        )
        resumed = self.state.parts["trainer"].step
        if resumed:  # from a checkpoint: the manager counts on from there
            self.manager.load_state_dict({"step": resumed, "batches_committed": 0})

    # The live state torchft hands a group that catches up ----------------------------------

    def _snapshot(self) -> dict:
        """Called in torchft's quorum thread while this group's step has not yet written anything."""
        state = self.state.state_dict()
        state.pop("data")  # every group keeps the cursor of its own shard
        return transfer_state(state)

    def _load(self, state: dict) -> None:
        """A peer's state, at the vote of the step this group catches up in."""
        self.faults.at("catch_up", self._step)
        grads = [p.grad for p in self.dense_params]  # the step's averaged gradients outlive the load
        load_transferred(self.state, state)
        for p, g in zip(self.dense_params, grads):
            p.grad = g
        self._saved = None  # the loaded rows supersede this attempt's updates
        log.info(f"caught up with a peer at step {int(state['trainer']['step'])}")

    # One step ----------------------------------------------------------------------------

    def begin(self) -> None:
        """Start the quorum of the step that follows the last committed one."""
        self._step = self.state.parts["trainer"].step + 1
        self._saved = None
        self._synced = None
        self.manager.start_quorum()

    def before_update(self, touched) -> None:
        """Save the rows the step is about to write, as they are: ``touched`` holds (row block,
        local rows) pairs (``freescale.ft.rows``; rows may repeat). Called once or more per step,
        before the first write."""
        if self._saved is None:
            self.manager.wait_quorum()  # a peer's snapshot for a group catching up is taken before any write
            self._step = self.manager.current_step() + 1  # the quorum's step (ahead of ours when catching up)
            self._saved = []
        for block, ids in touched:
            rows = torch.unique(ids)
            self._saved.append((block, rows, [t[rows].clone() for t in block]))

    def reduce_dense(self, flat: torch.Tensor) -> None:
        """Average ``flat`` (the replica's mean dense gradient) over the participating groups, in place."""
        self.faults.at("allreduce", self._step)
        self.manager.allreduce(flat).wait()

    def sync_embeddings(self, blocks) -> None:
        """At a sync step: every row block (``freescale.ft.rows``) averaged across the groups,
        into a copy that the vote puts in place if the step commits."""
        step, every = self._step, self.cfg.embedding_sync_every
        if not (step == self.last_step or (every and step % every == 0)):
            return
        synced = [(t, t.clone()) for block in blocks for t in block]
        works = [self.manager.allreduce(copy) for _, copy in synced]
        for w in works:
            w.wait()
        self._synced = synced

    def vote(self) -> Vote:
        step = self._step
        participating = self.manager.is_participating()
        if step in self.cfg.fail_commit_at and step not in self._failed:
            self._failed.add(step)  # the replayed attempt commits
            self.manager.report_error(InjectedFault(f"injected commit failure at step {step}"))
        self._scale_lr()
        stepped = self.manager.should_commit()
        rewritten = not participating or (self._synced is not None if stepped else self._saved is not None)
        if stepped:
            with torch.no_grad():
                for live, averaged in self._synced or []:
                    live.copy_(averaged)
        elif self._saved is not None:
            with torch.no_grad():
                for block, rows, saved in self._saved:
                    for live, values in zip(block, saved):
                        live[rows] = values
            log.warning(f"step {step} not committed ({self.manager.errored() or 'too few replicas'}): "
                        f"rolled back, its batch is trained again")
        self._saved = self._synced = None
        return Vote(stepped=stepped, trained=stepped and participating, rewritten=rewritten)

    def _scale_lr(self) -> None:
        if self.cfg.lr_scaling != "sqrt":
            return
        scale = math.sqrt(min(self.manager.num_participants(), self.cfg.num_replicas) / self.cfg.num_replicas)
        for group, lr in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = lr * scale

    def committed(self, step: int, next_batch: int, trained: bool = True) -> None:
        """After a committed step: the cursor of this group's shard (the group's rank 0 writes it)."""
        if step != self.manager.current_step():
            raise RuntimeError(f"step {step} but torchft's manager is at {self.manager.current_step()}")
        if self.rank == 0:
            self.files.write(step, next_batch, trained)

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def build_replica(cfg, topo, state, dense_params, optimizer, faults, run_dir: str):
    """The replica layer when ``ft.enable`` is on, else a ``NullReplica``."""
    if not cfg.ft.enable:
        return NullReplica()
    if "MASTER_ADDR" not in os.environ:
        from freescale.config import ConfigError

        raise ConfigError("ft.enable: a replica group runs under torchrun (one torchrun job per group; "
                          "`freescale local` starts them on one host)")
    return ReplicaLayer(cfg, topo, state, dense_params, optimizer, faults, ReplicaFiles(run_dir))
