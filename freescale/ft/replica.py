"""The replica layer: each torchrun job is one replica group, a fault domain of its own.

Every rank holds one torchft ``Manager``; the managers of rank ``r`` of every replica group
share a torchft process group, and a lighthouse (``freescale lighthouse``) forms the quorum of
the groups that are alive. ``ReplicaLayer`` is one rank's part of a step, the same object for
both kinds of tables (the *table side*: ``freescale.embedding.replicated`` for FreeScale's
own, ``freescale.ft.table_sync`` for TorchRec's). A step:

1. ``begin``: the quorum starts in torchft's thread; a group that is behind fetches a live
   peer's state meanwhile (catch-up) while the peers keep stepping;
2. forward and backward inside the group, as without the layer;
3. ``exchange_rows``: the step's header and row keys across the groups
   (``freescale.ft.row_exchange``): which groups take part, the data cursor each will hold if
   the step commits, and the union of the rows they contribute;
4. ``finish``: the dense gradients (already averaged over the group's ranks; each rank's
   shard of them under ``dense.sharding: fsdp``) averaged over the groups that take part (one
   that catches up contributes zeros), the row values summed over the union, then the vote.
   Before it, the ranks of the group check that they hold the same step and cursor (a tiny
   all-reduce); a mismatch fails the step. Committed: a group
   that caught up loads the peer's state now, every rank of the group at once (group-atomic:
   a failed vote drops it on every rank), the table side applies the summed rows, the dense
   optimizer steps, and the other groups' cursors are recorded. Not committed (a peer died,
   an error, too few groups, a failed fetch): what the step wrote goes back (the table side's
   rollback), torchft's step is put back to the trainer's and the same batch is trained again.

A cross-replica collective that fails aborts the process group at once (gloo's abort closes
its connections), so a peer blocked on this group in the same collective is released rather
than left waiting for a group that gave up; the next quorum rebuilds the group without the
dead replica. A group that hangs rather than dies keeps its sockets open and says nothing: the
hang watchdog (``freescale.ft.watchdog``) gives the step's collectives up once the lighthouse
has not heard the group for ``ft.hang_timeout_s``, and they fail the same way.

A batch that enters a step is in the model as soon as its contribution reaches the peers: they
may commit the step even if this group dies before its own vote. So the layer hands the batch
to ``on_contribute`` (the trainer's ledger) before its first cross-replica collective; a
record of a batch that no committed step holds is dropped when the group next starts (the
ledger is cut back to the committed cursor).

A group's data cursor travels with the state (``DataCursor`` holds every group's), so a group
that takes a peer's state learns from it which of its own batches that state has trained: the
batch in hand (the step's vote failed here after the peers committed it) or none.

``join`` runs before the first batch is drawn (the trainer calls it when the group has run
before). The newest state wins: if a live group is ahead of this one and not behind the job's
newest checkpoint, the group catches up from it in a *zero step* (it takes part in the peers'
step with zeros and loads their state); otherwise (every group was lost, or the live ones
never reached the newest checkpoint: a group that started late, or whose catch-up failed when
its peer died) it vetoes the step (no group commits it: a live group must not commit a step
on a state the restored one overtakes), loads the newest checkpoint of the job and tries
again, so the groups meet on the newest state and go on from there.

The layer drives torchft's parts but does not make them: ``build_manager`` makes the
``Manager`` and its process group, with the declared faults' wrappers around them
(``freescale.ft.faults``), and ``build_replica`` hands them to ``ReplicaLayer`` (a test hands
it fakes: ``tests/helpers/fake_manager.py``). The pipelines that call ``exchange_rows`` and
``finish`` are the replicated variants (``freescale.train.pipelines.REPLICATED``), chosen when
``ft.enable`` is on; no plain pipeline asks whether the layer is there.

Off (``ft.enable: false``) the trainer holds a ``NullReplica`` (the trainer's calls: ``join``,
``committed``, ``check_group``, ``close``; every step commits and trains).
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp

from freescale.device import CopyEngine, staged_on_host
from freescale.env import TORCHFT_LIGHTHOUSE
from freescale.ft.catchup import load_transferred, transfer_state
from freescale.ft.files import ReplicaFiles
from freescale.ft.row_exchange import Header, RowPlan, empty_plan, pack_header, pack_keys, plan_rows, read_header
from freescale.model.dense_sharding import local_gradients
from freescale.profile.timeline import phase

log = logging.getLogger("freescale")

LIGHTHOUSE_ENV = TORCHFT_LIGHTHOUSE
NO_KEYS = torch.zeros(0, dtype=torch.int64)
STATE_KEY = "freescale"  # the layer's state among the manager's registered state dicts


@dataclass(frozen=True)
class Vote:
    """How a step ended: ``stepped``, the model took the step (its counter advances);
    ``trained``, this group's batch is in the model (its cursor and ledger advance);
    ``rewritten``, the group took a peer's state: rows read before the vote are stale."""

    stepped: bool
    trained: bool
    rewritten: bool = False


COMMITTED = Vote(stepped=True, trained=True)


@dataclass(frozen=True)
class Restore:
    """The job's newest checkpoint, for a group that joins: its ``step`` (0: none) and ``load``,
    which loads it into the training state (the newest then: it may have moved on)."""

    step: int
    load: Callable[[], None]


class NullReplica:
    """No replica layer: one group, every step commits."""

    enabled = False
    on_contribute = None

    def begin(self) -> None:
        pass

    def vote(self) -> Vote:
        return COMMITTED

    def join(self, restore: Restore | None) -> None:
        pass

    def committed(self, step: int, next_batch: int, trained: bool = True) -> None:
        pass

    def check_group(self, where: str) -> None:
        pass

    def close(self) -> None:
        pass


class ReplicaLayer:
    """One rank's part of the replica layer (see the module docstring).

    ``manager`` and ``pg`` are torchft's ``Manager`` and the process group it was built over
    (``build_manager``: the declared faults' wrappers and the hang watchdog already around
    them; ``watchdog``, closed with the layer); the layer registers its state with the manager
    and drives both, and a test hands it fakes."""

    enabled = True

    def __init__(self, cfg, topo, state, dense_params: list, optimizer, side, files: ReplicaFiles, *,
                 manager, pg, watchdog=None) -> None:
        ft = cfg.ft
        self.cfg = ft
        self.replicas = ft.num_replicas
        self.replica = ft.replica_id
        self.state = state
        self.dense_params = dense_params
        self.optimizer = optimizer
        self.side = side
        self.files = files
        self.rank = topo.rank
        self.group = topo.pg
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self._step = state.parts["trainer"].step + 1  # the step being attempted (the quorum's)
        self._quorum_open = False  # a quorum join() started, which the first step takes
        self._failed = False  # a cross-replica collective of this step failed
        self._copy_engine: CopyEngine | None = None  # device <-> host copies, made at the first device tensor
        self._header: Header | None = None
        self._stash: dict | None = None  # a peer's state, until the group's vote
        self._joining = False
        self._blocked_s = 0.0  # the step's time waiting for the other groups (quorum, collectives)
        # (step, batch): called with this group's batch before it enters the step's first
        # cross-replica collective (from then on the peers may commit it)
        self.on_contribute: Callable[[int, object], None] | None = None
        self.pg = pg
        self.manager = manager
        if watchdog is None:
            from freescale.ft.watchdog import NullWatchdog

            watchdog = NullWatchdog()
        self.watchdog = watchdog  # (closed with the layer)
        manager.register_state_dict_fn(STATE_KEY, self._receive, self._snapshot)
        self._put_back_step()

    @property
    def trainer_step(self) -> int:
        return self.state.parts["trainer"].step

    @property
    def cursor(self):
        return self.state.parts["data"]

    # The live state torchft hands a group that catches up ----------------------------------

    def _snapshot(self) -> dict:
        """Called in torchft's quorum thread, before this group writes anything in the step."""
        with phase("catch_up_snapshot"):
            return transfer_state({"training": self.state.state_dict(), "tables": self.side.state_dict()})

    def _receive(self, state: dict) -> None:
        """A peer's state, at this rank's vote: kept until the group has voted."""
        self._stash = state

    def _adopt(self, state: dict) -> None:
        grads = [p.grad for p in self.dense_params]  # the step's averaged gradients outlive the load
        with phase("catch_up"):
            load_transferred(self.state, state["training"])
            self.side.load_state_dict(state["tables"])
        for p, g in zip(self.dense_params, grads):
            p.grad = g
        log.info(f"caught up with a peer at step {self.trainer_step}")

    # One step ------------------------------------------------------------------------------

    def begin(self) -> None:
        """Start the quorum of the step that follows the last committed one."""
        self._failed = False
        self._header = None
        if self._quorum_open:
            self._quorum_open = False
        else:
            self.manager.start_quorum()

    def wait_quorum(self) -> int:
        """Wait for the step's quorum (and, for a group catching up, the peer's state); the
        step's number (ahead of the trainer's when catching up)."""
        waited = time.perf_counter()
        self.manager.wait_quorum()
        self._blocked_s += time.perf_counter() - waited
        self._step = self.manager.current_step() + 1
        return self._step

    def before_update(self, touched) -> None:
        """The rows the step is about to write in backward (TorchRec's fused tables), before the
        first write: the table side saves them (``touched``: (block, local rows) pairs)."""
        self.wait_quorum()  # a peer's snapshot for a group catching up is taken before any write
        self.side.touch(touched)

    def exchange_rows(self, keys: torch.Tensor, batch=None, veto: bool = False) -> RowPlan:
        """The step's header and the union of every group's row ``keys`` (sorted unique keys of
        the table side's row space). ``batch``: this group's batch in the step (None: no batch,
        a group that catches up); ``veto``: no group may commit the step (a group about to load
        the job's newest checkpoint)."""
        self.wait_quorum()
        present = batch is not None and self.manager.is_participating()
        if present and self.on_contribute is not None:
            self.on_contribute(self._step, batch)
        header = pack_header(self.replicas, self.replica, self.cursor.next_batch + 1 if present else None,
                             len(keys), veto=veto)
        if not self._allreduce(header, absent_zero=False):
            return empty_plan(self.side.space)
        self._header = read_header(header, self.replicas)
        counts = self._header.counts
        if not int(counts.sum()):
            return empty_plan(self.side.space)
        gathered = pack_keys(keys[:int(counts[self.replica])], counts, self.replica)
        if not self._allreduce(gathered):
            return empty_plan(self.side.space)
        return plan_rows(self.side.space, gathered)

    def reduce_dense(self, params: list) -> None:
        """The gradients of ``params`` (the group's mean) averaged over the groups that take part,
        as this rank holds them (``local_gradients``): under ``dense.sharding: fsdp`` its shard
        alone, which rank r of every group holds alike (the groups shard the same model over the
        same number of ranks), so only 1/N of the gradient crosses between groups per rank.

        (FSDP2's ``set_all_reduce_hook``, as torchft's FSDP test uses it, would run this inside
        backward, once per block: before the step's header under ``sync``, whose ledger entry
        and participation must come before the first cross-group collective. One all-reduce of
        the shards here, in the step's order, sends the same bytes.)"""
        grads = local_gradients(params)
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self._allreduce(flat):
            flat /= max(1, self.manager.num_participants())
        at = 0
        for g in grads:
            g.copy_(flat[at:at + g.numel()].view_as(g))
            at += g.numel()

    def finish(self, plan: RowPlan, values: torch.Tensor) -> Vote:
        """The rest of the step (module docstring, 4.): ``values`` is this group's part of the
        rows in ``plan``'s layout."""
        self.reduce_dense(self.dense_params)
        if plan.size:
            self._allreduce(values)
        vote = self.vote()
        if vote.stepped:
            self.side.apply(plan, values)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return vote

    def vote(self) -> Vote:
        self.wait_quorum()
        self._check_group()
        self._check_members()
        self._check_vetoes()
        self._scale_lr()
        before = self.cursor.next_batch
        stepped = self.manager.should_commit()
        trained = stepped and self.manager.is_participating()
        if not stepped:
            self.side.rollback()
            self._put_back_step()
            cause = str(self.manager.errored() or "too few replicas").splitlines()[0][:200]
            vetoed = self._header is not None and bool(self._header.vetoes[self.replica])  # (its own doing)
            if not self._joining:
                log.warning(f"step {self._step} not committed ({cause}): rolled back, its batch is trained again")
            elif not vetoed and (self._stash is not None or not self.manager.is_participating()):
                log.warning(f"catching up in step {self._step} failed ({cause}): the group tries again")
            self._stash = None
            return Vote(stepped=False, trained=False)
        stash, self._stash = self._stash, None
        if stash is not None:
            self._adopt(stash)
            trained = self._trained_by_peers(before, self.cursor.next_batch)
        self._record_cursors()
        self.side.committed()
        return Vote(stepped=True, trained=trained, rewritten=stash is not None)

    def committed(self, step: int, next_batch: int, trained: bool = True) -> None:
        """After a committed step: the group's progress (its rank 0 writes it)."""
        if step != self.manager.current_step():
            raise RuntimeError(f"step {step} but torchft's manager is at {self.manager.current_step()}")
        if self.rank == 0:
            self.files.write(step, next_batch, trained, self._blocked_s)
        self._blocked_s = 0.0

    # Parts of a step -----------------------------------------------------------------------

    def _allreduce(self, tensor: torch.Tensor, absent_zero: bool = True) -> bool:
        """Sum ``tensor`` over the groups in place (zeros from a group that catches up, as
        torchft does); False once anything failed in the step, which the vote then fails."""
        if self._failed:
            return False
        if absent_zero and not self.manager.is_participating():
            tensor.zero_()
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        waited = time.perf_counter()
        try:
            # A device tensor goes through pinned host memory by the copy engine (no kernel of
            # ours on the GPU): the groups' gloo process group sums host memory.
            staged_on_host(tensor, lambda t: self.pg.allreduce([t], opts).wait(), self._copies(tensor))
        except Exception as e:
            self.manager.report_error(e)
            self._abort(e)
            return False
        finally:
            self._blocked_s += time.perf_counter() - waited
        return True

    def _copies(self, tensor: torch.Tensor) -> CopyEngine | None:
        if tensor.device.type == "cpu":
            return None
        if self._copy_engine is None:
            self._copy_engine = CopyEngine(tensor.device)
        return self._copy_engine

    def _abort(self, cause: Exception) -> None:
        """Give up the step's collectives: the process group is aborted, which fails the peers'
        side of them at once; the next quorum builds a new one."""
        self._failed = True
        log.warning(f"a cross-replica collective failed ({str(cause).splitlines()[0][:200]}): "
                    f"aborting it so the other groups go on")
        try:
            self.pg.abort()
        except Exception:  # already torn down
            pass

    def _check_group(self, where: str = "") -> None:
        """Every rank of the group holds the same trainer step, torchft step and data cursor;
        a mismatch fails the step (or, with ``where``, raises)."""
        mine = torch.tensor([self.trainer_step, self.manager.current_step(), self.cursor.next_batch],
                            dtype=torch.int64)
        both = torch.cat([mine, -mine])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        if torch.equal(both[:3], -both[3:]):
            return
        message = (f"the ranks of replica {self.replica} disagree (trainer step {-int(both[3])}..{int(both[0])}, "
                   f"torchft step {-int(both[4])}..{int(both[1])}, data cursor {-int(both[5])}..{int(both[2])})")
        if where:
            raise RuntimeError(f"{message} at {where}")
        if not self.manager.errored():  # (a rank's own failure is the cause to report)
            self.manager.report_error(RuntimeError(message))

    def _members(self) -> int:
        """Groups in the step's quorum, a group catching up included (0 before its header)."""
        return int(self._header.members.sum()) if self._header is not None else 0

    def _check_members(self) -> None:
        """``ft.min_replicas``: groups in the step's quorum, a group catching up included (it
        counts for the quorum, and must be able to commit the step it catches up in)."""
        members = self._members()
        if members < self.cfg.min_replicas and not self.manager.errored():
            self.manager.report_error(RuntimeError(f"{members} replica group(s) in the step, "
                                                   f"ft.min_replicas is {self.cfg.min_replicas}"))

    def _check_vetoes(self) -> None:
        """A group that vetoes the step (it loads the job's newest checkpoint) fails it everywhere."""
        if self._header is None or self.manager.errored():
            return
        vetoes = self._header.vetoes.nonzero().flatten().tolist()
        if vetoes:
            names = ", ".join(f"replica{g}" for g in vetoes)
            self.manager.report_error(RuntimeError(f"replica group {names} vetoed the step: it loads the job's newest "
                                                   f"checkpoint, which the live groups then catch up from"))

    def check_group(self, where: str) -> None:
        """Raise if the ranks of the group do not hold the same step and cursor (the end of a run)."""
        self._check_group(where)

    def _trained_by_peers(self, before: int, after: int) -> bool:
        """Whether the state taken from a peer has trained this group's batch in hand (the
        batch at ``before``): the peers committed a step with it that this group's vote lost."""
        if after == before + 1:
            return True
        if after == before or self._joining:
            return False
        raise RuntimeError(f"replica {self.replica} took a peer's state that holds its data cursor at batch {after}, "
                           f"but it is at batch {before}: restart the group to rejoin")

    def _record_cursors(self) -> None:
        """The other groups' cursors as the committed step leaves them."""
        if self._header is None:
            return
        for g in self._header.present.nonzero().flatten().tolist():
            if g != self.replica:
                self.cursor.positions[g] = int(self._header.cursors[g])

    def _put_back_step(self) -> None:
        self.manager.load_state_dict({"step": self.trainer_step, "batches_committed": self.manager.batches_committed()})

    def _scale_lr(self) -> None:
        if self.cfg.lr_scaling != "sqrt":
            return
        scale = math.sqrt(min(self.manager.num_participants(), self.cfg.num_replicas) / self.cfg.num_replicas)
        for group, lr in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = lr * scale

    # Joining -------------------------------------------------------------------------------

    def join(self, restore: Restore | None) -> None:
        """Settle the state of a group that has run before, before it draws a batch (module
        docstring); ``restore``: the job's newest checkpoint (None: the state is the one to go
        on from, a checkpoint the launch resumed)."""
        self._joining = True
        restored = False
        try:
            while True:
                self.begin()
                self.wait_quorum()
                behind = not self.manager.is_participating()  # a live group is ahead
                furthest = self._furthest_step()
                if restore is not None and not restored and (not behind or restore.step > furthest):
                    if behind:
                        log.info(f"the live replica groups are at step {furthest}, behind the job's newest "
                                 f"checkpoint (step {restore.step}): loading it, and they catch up from this group")
                    else:
                        log.info("no live replica group is ahead of this one (the others were lost, or finished): "
                                 "loading the job's newest checkpoint")
                elif behind:  # catch up from the live group ahead
                    if self._zero_step().stepped:
                        self.state.parts["trainer"].step += 1
                        self.committed(self.trainer_step, self.cursor.next_batch, trained=False)
                        return
                    continue
                else:
                    self._quorum_open = True  # the first step runs in this quorum
                    return
                self._zero_step(veto=True)
                restore.load()
                self.side.load_state_dict({})
                self._put_back_step()
                if self.rank == 0:
                    self.files.write_progress(self.trainer_step, self.cursor.next_batch)
                restored = True
        finally:
            self._joining = False

    def _furthest_step(self) -> int:
        """The quorum's furthest committed step, the same on every rank of the group: torchft moves
        a rank's step to the peer's only once its fetch succeeded, so a rank whose fetch failed
        still holds its own (the group's highest is the quorum's, unless every fetch failed)."""
        step = torch.tensor([self.manager.current_step()], dtype=torch.int64)
        dist.all_reduce(step, op=dist.ReduceOp.MAX, group=self.group)
        return int(step)

    def _zero_step(self, veto: bool = False) -> Vote:
        """Take part in the peers' step with zeros (no batch); ``veto``: no group commits it."""
        plan = self.exchange_rows(NO_KEYS, batch=None, veto=veto)
        for p in self.dense_params:
            p.grad = torch.zeros_like(p)
        if veto:
            self.manager.report_error(RuntimeError("joining: this group vetoes the step"))
        return self.finish(plan, torch.zeros(plan.size))

    def close(self) -> None:
        self.watchdog.close()
        self.manager.shutdown(wait=False)


def build_manager(cfg, topo, faults, *, step: Callable[[], int], groups_in_step: Callable[[], int]):
    """torchft's ``Manager`` of this rank and its process group (torchft's ``ProcessGroupGloo``,
    joining rank ``topo.rank`` of every group, its builds watched too), each inside the wrapper of the faults declared there
    (``freescale.ft.faults``; the part itself when none is), the group watched by the hang
    watchdog (``freescale.ft.watchdog``): ``(manager, pg, watchdog)``. The wrappers read
    ``step`` (the step being attempted) and ``groups_in_step`` (the groups in its quorum)."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's managers log every quorum and vote at info
    from torchft import Manager
    from torchft.checkpointing import HTTPTransport

    from freescale.ft.faults import wrap_manager, wrap_process_group, wrap_transport
    from freescale.ft.watchdog import build_watchdog

    ft = cfg.ft
    timeout = timedelta(seconds=ft.timeout_s)
    lighthouse = os.environ.get(LIGHTHOUSE_ENV) or ft.lighthouse
    watchdog = build_watchdog(ft, lighthouse)  # a hung group's collectives given up in seconds
    pg = watchdog.watch(wrap_process_group(watchdog.gloo(timeout), faults, step))
    manager = Manager(
        pg=pg,
        load_state_dict=None,  # (the layer registers its state: ReplicaLayer)
        state_dict=None,
        min_replica_size=1,  # ft.min_replicas is checked at the vote, counting a group that catches up
        use_async_quorum=True,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=ft.quorum_timeout_s),
        connect_timeout=timeout,
        rank=topo.rank,
        world_size=topo.world_size,
        lighthouse_addr=lighthouse,
        replica_id=f"replica{ft.replica_id}",
        checkpoint_transport=wrap_transport(HTTPTransport(timeout=timeout, num_chunks=0), faults),
        init_sync=False,  # every group draws the same initial weights from run.seed
    )
    return wrap_manager(manager, faults, groups_in_step, ft.num_replicas), pg, watchdog


def build_replica(cfg, topo, state, dense_params, optimizer, side, faults, run_dir: str):
    """The replica layer over torchft's parts (``build_manager``) when ``ft.enable`` is on, else
    a ``NullReplica``."""
    if not cfg.ft.enable:
        return NullReplica()
    if "MASTER_ADDR" not in os.environ:
        from freescale.config import ConfigError

        raise ConfigError("ft.enable: a replica group runs under torchrun (one torchrun job per group; "
                          "`freescale local` starts them on one host)")
    layer: ReplicaLayer | None = None  # the fault wrappers ask it, once built, where the step is
    manager, pg, watchdog = build_manager(cfg, topo, faults, step=lambda: layer._step,
                                          groups_in_step=lambda: layer._members())
    layer = ReplicaLayer(cfg, topo, state, dense_params, optimizer, side, ReplicaFiles(run_dir), manager=manager, pg=pg,
                         watchdog=watchdog)
    return layer
