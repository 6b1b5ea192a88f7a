"""Training over FreeScale's own sharded tables: the synchronous reference and the prioritized pipeline.

Both train the same model (``OwnedModel``: ``ShardedTables`` for the item, user and side-feature
tables, the dense task replicated or sharded over the ranks: ``dense.sharding``) on the same batches and
give bitwise the same result on CPU; they differ in when the embedding exchanges happen.

``sync`` (the reference), per step: exchange the batch's ids, look up and exchange its rows,
forward and backward, exchange the gradients and update every row, step the dense optimizer.

``prioritized``: batch i+1's ids reach their owners while batch i computes (batch i+2's are
on their way). Each owner splits the rows i+1 reads into collision rows (batch i writes them)
and exclusive rows (``rows.py``) and tells the senders which of their ids are which (a small
all-to-all of flags on the high lane). Step i:

1. batch i+2 is loaded and its id exchange prepared;
2. forward of batch i; its first read of its rows waits for them (the exclusive rows sent in
   step i-1, the collision rows sent after batch i-1's update): everything since they were
   sent overlapped the transfer;
3. batch i-1's deferred gradients (rows i does not read; their exchange overlapped the loading
   and the forward) are applied: the next line is the step's first read of the tables;
4. only batch i+1's exclusive rows (batch i does not write them: they are final) are looked up
   and sent (normal lane); no row is sent twice. (The split of batch i+1's rows and the flags
   that tell each sender which of its ids are which went before the forward, on the high
   lane: what batch i writes is known then.)
5. backward of batch i; the dense all-reduce starts; batch i+2's ids are sent;
6. batch i's collision gradients go first (high lane); the dense optimizer steps while they
   cross (as TorchRec's PEC steps it beside its overlapping gradients); the owners update
   those rows and send batch i+1's collision rows (high lane): the only exchange waited for
   in full;
7. batch i's other gradients are sent (normal lane), to be applied at 3. of the next step
   (between a sender and an owner with few collision rows, the whole block with those rows
   zeroed: it is applied as it comes). Nothing waits for batch i+1's rows here: the wait is
   at 2.

On a transport of one lane (``transport.lanes: 1``) the schedule is the same, in the same
order, with every exchange on that lane: what the high lane would carry queues behind the
normal exchanges issued before it (at 6., batch i+1's exclusive rows and batch i+2's ids)
instead of passing them. Every rank issues the same exchanges in the same order, so they pair
up; the numerics do not change.

Every row is updated by the same fused-optimizer arithmetic over the same gradients in the
same order as in ``sync``, and read only after every update before it: the numerics are
identical. The pipeline drains (``drain``: applies the deferred gradients) before evaluation,
before a checkpoint and at the end of the data.

Under the replica layer a step's row gradients are summed across the groups and applied after
the vote, in both pipelines: their replicated variants (``freescale.embedding.replicated``,
chosen at build time when ``ft.enable`` is on) are subclasses that override the hooks of
these schedules where the layer takes part (``_begin_step``, ``_draw`` and ``_end_step`` of
``sync``; ``_stage_after``, ``_before_forward``, ``_between_forward_and_backward``,
``_finish`` and ``_finish_last`` of ``prioritized``); the schedules here ask nothing about it.

On CPU the exchanges run in the transport's threads (gloo's, or the ``host_staged`` proxy)
while this rank's main thread computes; the timeline marks the waits: ``id_wait``,
``flags_wait``, ``exclusive_wait`` (a batch's rows, inside its forward at their first read; and
deferred gradients) and ``collision_wait``, and records each step's collision rate and the bytes
of its exchanges between ranks: the trained batch's ids, rows and gradients
(``exchange_bytes``, both pipelines) and the collision exchange (``collision_bytes``,
``prioritized``), from which ``freescale.profile.comm_bound`` bounds the exposed communication
on a link. On a GPU the tables live in device memory and the exchanges that are not waited for at once (batch
i+1's exclusive and collision rows, batch i's deferred gradients: their lookups and sends) are
issued on a side stream (``freescale.device.Streams``): it waits for the compute stream first,
and the compute stream waits for it before reading what came back; ``drain`` leaves the compute
stream after the side stream's last table update (the exclusive rows' lookups run there, so
their backward, which applies the deferred updates in place, runs there too).

The host never waits for the device inside a step: the ids are routed on the host
(``exchange``), the collision split, the flags and every count and mask are host tensors,
and what the device needs of them (the positions a mask selects) is copied to it without
waiting. Between the start of batch i's forward and the issue of its backward (batch i+1's
exclusive rows sent in between) nothing reads a value back from the device
(``tests/dist/test_sync_budget.py`` counts it).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from freescale.data.batch import Batch, SideLayout
from freescale.device import Streams, to_device
from freescale.embedding.exchange import PendingRoute, Route, ShardedTables, counts_by
from freescale.embedding.rows import RowMarks
from freescale.ft.replica import COMMITTED
from freescale.model.dense_sharding import DENSE_SHARDINGS, DenseReduction, Replicate
from freescale.model.seqrec import ITEM_TABLE, USER_TABLE, build_task, task_arguments, task_settings
from freescale.model.side import SideSpec, pool_bags, side_specs
from freescale.transport.base import HIGH, NORMAL


class OwnedModel(nn.Module):
    """The sequence model over ``ShardedTables``: the tables' rows come in, the loss goes out.

    The tables are the item table, the user table (``model.user_features``) and one per side
    feature (``side``, in ``side_specs`` order). A side feature's every value is looked up as a
    row, and its rows are pooled per bag in the dense part (``pool_bags``): a user feature's bags
    are the samples; a sequence item feature's the history events, then the candidates; a pooled
    item feature's only the candidates (the history events' values are not sent)."""

    def __init__(self, tables: ShardedTables, task: nn.Module, user_features: bool,
                 side: list[SideSpec] = (), dense_sharding=Replicate()) -> None:
        super().__init__()
        self.tables = tables
        self.task = task
        self.dense_sharding = dense_sharding  # how the group's ranks hold ``task`` (``dense.sharding``)
        # The task's parameters as the optimizer holds them (under fsdp, the shards: FSDP swaps
        # the whole ones in for a block's forward and backward) and the names of its state.
        self._task_params = dict(task.named_parameters())
        self._task_keys = list(task.state_dict())
        self.user_features = user_features
        self.side = list(side)
        self.first_side_table = 2 if user_features else 1

    def side_bags(self, batch: Batch) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(ids, bag lengths) of each side feature, as ``segments`` sends them (host tensors)."""
        if not self.side:
            return []
        users, items = batch.user_side_features.to_dict(), batch.item_side_features.to_dict()
        n_uih = int(batch.uih_lengths.sum())
        bags = []
        for spec in self.side:
            jagged = (users if spec.user else items)[spec.key]
            if spec.user or spec.sequence:
                bags.append((jagged.values(), jagged.lengths()))
            else:  # the candidates' bags alone
                start = int(jagged.offsets()[n_uih])
                bags.append((jagged.values()[start:], jagged.lengths()[n_uih:]))
        return bags

    def segments(self, batch: Batch) -> list[tuple[int, torch.Tensor]]:
        """(table, global ids) of the batch in the order its rows are used: UIH and candidates,
        users, each side feature's values (host tensors: the batch's ids stay on the host)."""
        segs = [(0, batch.seq_features.values())]
        if self.user_features:
            segs.append((1, batch.user_features.values()))
        segs += [(self.first_side_table + t, ids) for t, (ids, _) in enumerate(self.side_bags(batch))]
        return segs

    def dense(self, batch: Batch, rows: torch.Tensor):
        """(loss, StepOutput) from the batch's rows in ``segments`` order."""
        n_uih = int(batch.uih_lengths.sum())  # (host tensors: no wait)
        n_items = batch.seq_features.values().numel()
        n_users = len(batch) if self.user_features else 0
        user = rows[n_items:n_items + n_users] if self.user_features else None
        if not self.side:
            return self.task(rows[:n_uih], rows[n_uih:n_items], user, *task_arguments(batch))
        user_side, item_side = {}, {}
        at = n_items + n_users
        for spec, (ids, lengths) in zip(self.side, self.side_bags(batch)):
            pooled = pool_bags(rows[at:at + ids.numel()], lengths, spec.max_values, spec.pooling)
            (user_side if spec.user else item_side)[spec.key] = pooled
            at += ids.numel()
        return self.task(rows[:n_uih], rows[n_uih:n_items], user, user_side, item_side, *task_arguments(batch))

    # Checkpoints: the dense part as usual, the tables as row-sharded DTensors.

    def state_dict(self, *args, **kwargs) -> dict:
        """(Read from the parameters the optimizer holds, not through ``task.state_dict()``: a
        catch-up snapshot is taken in torchft's thread while this rank's forward may hold a
        block's whole parameters, and FSDP's state-dict hook would swap the shards back in.)"""
        out = {f"task.{k}": (self._task_params[k].detach() if k in self._task_params else self.task.get_buffer(k))
               for k in self._task_keys}
        out.update({f"tables.{k}": v for k, v in self.tables.sharded_state().items()})
        return out

    def load_state_dict(self, state: dict, strict: bool = True):
        self.task.load_state_dict({k[len("task."):]: v for k, v in state.items() if k.startswith("task.")}, strict=strict)
        self.tables.load_sharded_state({k[len("tables."):]: v for k, v in state.items() if k.startswith("tables.")})


def build_owned_model(cfg, *, num_items: int, max_uih_len: int, topology, seed: int,
                      device: torch.device | str = "cpu", side_layout: SideLayout = SideLayout()) -> OwnedModel:
    """The model with its tables sharded row-wise over the replica's ranks (``cfg``: the
    experiment; ``side_layout``: the source's side features), tables and dense part on ``device``."""
    from freescale.config import check_owned_side_dim

    for i in range(len(cfg.model.side_features)):
        check_owned_side_dim(cfg.model, i, "train.pipeline sync and prioritized, freescale verify")
    side = side_specs(cfg.model, side_layout)
    tables = {ITEM_TABLE: num_items}
    if cfg.model.user_features:
        tables[USER_TABLE] = cfg.model.user_hash_size
    tables.update({spec.table: spec.rows for spec in side})
    sharded = ShardedTables(tables, cfg.model.embedding_dim, rank=topology.rank, world_size=topology.world_size,
                            group=topology.pg, optimizer=cfg.embedding.optimizer, lr=cfg.embedding.lr,
                            init_std=cfg.embedding.init_std, seed=seed, device=device)
    settings = {**task_settings(cfg), "max_uih_len": max_uih_len}
    task = build_task(cfg.model, **settings, side_specs=side).to(device)
    dense_sharding = DENSE_SHARDINGS[cfg.dense.sharding]
    task = dense_sharding.shard(task, topology.pg)
    return OwnedModel(sharded, task, cfg.model.user_features, side, dense_sharding)


@dataclass
class _Staged:
    """A batch whose ids have been (or are being) exchanged."""

    batch: Batch
    pending: PendingRoute
    route: Route | None = None
    rows: torch.Tensor | None = None  # the batch's rows in batch order, once assembled
    # The owner's tracked lookup of rows asked for (its backward updates them), and which of
    # the ids received (shard-major) it leaves out (a host mask; None: none), looked up again
    # when updated.
    looked_up: torch.Tensor | None = None
    left_out: torch.Tensor | None = None
    # Set when the previous batch is known: which of this batch's ids (owner-major, as sent) and
    # of the ids it received (shard-major, as owner) are collision rows (host masks).
    sent_collide: torch.Tensor | None = None
    owned_collide: torch.Tensor | None = None
    # The rows on their way: the exclusive rows (sent early) and the collision rows (sent after
    # the previous batch's update); assembled at the forward's first read.
    exclusive: object | None = None
    collision: object | None = None

    def wait_route(self) -> Route:
        if self.route is None:
            self.route = self.pending.wait()
        return self.route


class _Deferred:
    """Gradients of rows the next batch does not read, on their way to their owners (zero for
    the collision rows, already updated)."""

    def __init__(self, handle, staged: _Staged, positions: torch.Tensor | None) -> None:
        self.handle = handle
        self.staged = staged
        self.positions = positions  # where the gradients go among the ids received (on the device; None: all, in order)


class OwnedTablesPipeline:
    """What the pipelines over ``OwnedModel`` share: staging a batch, looking up its rows,
    forward and backward, the dense step, evaluation. ``progress(batches)`` trains one batch
    and returns its ``StepOutput``, like TorchRec's pipelines; the subclasses say when the
    exchanges happen, and their replicated variants (``freescale.embedding.replicated``)
    override the hooks where the replica layer takes part in a step."""

    def __init__(self, model: OwnedModel, optimizer, transport, group: dist.ProcessGroup, timeline) -> None:
        self.model = model
        self.optimizer = optimizer
        self.transport = transport
        self.group = group
        self.timeline = timeline
        self.tables = model.tables
        self.device = model.tables.device
        # The exchanges a step does not wait for at once go on a side stream (on CPU: none).
        self.streams = Streams(self.device)
        self.side = self.streams.side()
        self.dense_params = [p for p in model.task.parameters() if p.requires_grad]
        # The lane of the exchanges that go first (the collision rows' and the flags): the high
        # lane where the transport has one; on a transport of one lane every exchange queues in
        # the order issued, which is the same on every rank.
        self.high = HIGH if transport.lanes > HIGH else NORMAL
        self.row_bytes = self.tables.dim * self.tables.weight.element_size()  # a row, or its gradient
        self.vote = COMMITTED  # (every step commits: the replicated variants vote)

    # Whether a batch's rows are updated through its tracked lookup (fbgemm's fused update, when
    # the pipeline applies the batch's gradients); the replicated variants apply the groups'
    # sums themselves, after the vote.
    tracked = True

    def progress(self, batches: Iterator):
        raise NotImplementedError

    def _begin_step(self) -> None:
        """Before anything of a step (the replicated variants start its quorum here)."""

    def _stage(self, batch: Batch | None, wait: bool = True) -> _Staged | None:
        """Start routing ``batch``'s ids (from the host) and move what the dense part reads to the device."""
        if batch is None:
            return None
        pending = self.tables.route(self.transport, self.model.segments(batch))
        staged = _Staged(batch.to(self.device, sparse=False), pending)
        if wait:
            with self.timeline.span("id_wait"):
                staged.wait_route()
        return staged

    def _lookup_all(self, staged: _Staged, track: bool = False) -> torch.Tensor:
        """The batch's rows, every one looked up now (the sync path, the first batch, evaluation)."""
        route = staged.wait_route()
        looked_up = self.tables.lookup(route.device_ids, track=track)
        staged.looked_up, staged.left_out = (looked_up if track else None), None
        staged.exclusive = staged.collision = None
        with self.timeline.span("exclusive_wait"):
            got = self.transport.all_to_all_single(looked_up.detach(), route.recv_counts, route.send_counts).wait()
        return route.to_batch(got)

    def _forward_backward(self, batch: Batch, rows, between=None):
        """Forward and backward of ``batch``; ``rows``: its rows, or a callable that waits for them
        (called at the forward's first read)."""
        with self.timeline.span("forward"):
            leaf = (rows() if callable(rows) else rows).detach().requires_grad_()
            loss, out = self.model.dense(batch, leaf)
        if between is not None:
            between()
        with self.timeline.span("backward"):
            loss.backward()
        grads = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        return loss, out, grads

    def _reduce_dense(self):
        """Start averaging the dense gradients over the replica's ranks (as ``dense.sharding``
        says: ``freescale.model.dense_sharding``)."""
        return self.model.dense_sharding.reduction(self.dense_params, self.group)

    def _dense_step(self, reduction: "DenseReduction | None" = None) -> None:
        reduction = reduction or self._reduce_dense()
        with self.timeline.span("optimizer"):
            reduction.wait()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def drain(self) -> None:
        """Apply every deferred update: the tables then hold what synchronous training would."""

    def _on_device(self, host: torch.Tensor) -> torch.Tensor:
        return to_device(host, self.device)

    def _note_exchange(self, staged: _Staged) -> None:
        """The bytes the batch's embedding exchange puts on the wire between this rank and the
        others, on the step's record (``exchange_bytes``): for each id this rank sends another
        rank, the id, its row coming back and its gradient going out. Summed over the ranks this
        is every byte of the batch's ids, rows and gradients that crosses between ranks (the rows
        an owner sends are the ids the others sent it), so its mean is one rank's share of it,
        whichever schedule moves them (what a schedule adds of its own, flags or zeroed rows, is
        not counted)."""
        counts = staged.pending.send_counts
        remote = sum(counts) - counts[self.tables.rank]
        self.timeline.note("exchange_bytes", remote * (staged.pending.local_sorted.element_size() + 2 * self.row_bytes))

    def _remote(self, staged: _Staged, mask: torch.Tensor) -> int:
        """How many of this rank's ids of ``staged`` (owner-major) that host ``mask`` keeps another rank owns."""
        return int((mask & (staged.route.owners != self.tables.rank)).sum())

    def _at(self, mask: torch.Tensor) -> torch.Tensor:
        """The positions host ``mask`` selects, on the device (a mask applied on the device would
        make the host wait to learn how many there are)."""
        return self._on_device(_positions(mask))

    @contextmanager
    def evaluating(self):
        """A callable ``model(batch) -> (loss, StepOutput)`` that looks up every row now (no update)."""
        self.drain()
        self.model.eval()
        try:
            with torch.no_grad():
                yield lambda batch: self.model.dense(batch, self._lookup_all(self._stage(batch)))
        finally:
            self.model.train()


class SyncEmbeddingPipeline(OwnedTablesPipeline):
    """The synchronous reference: every exchange of a step waited for where it is issued."""

    def progress(self, batches: Iterator):
        self._begin_step()
        staged = self._stage(self._draw(batches))
        self._note_exchange(staged)
        rows = self._lookup_all(staged, track=self.tracked)
        loss, out, grads = self._forward_backward(staged.batch, rows)
        dense = self._reduce_dense()
        route = staged.route
        with self.timeline.span("collision_wait"):
            got = self.transport.all_to_all_single(route.to_owner(grads), route.send_counts, route.recv_counts).wait()
        self._end_step(staged, got, dense)
        return out

    def _draw(self, batches: Iterator) -> Batch:
        """The batch the step trains."""
        return next(batches)

    def _end_step(self, staged: _Staged, got: torch.Tensor, dense: "DenseReduction") -> None:
        """The step's updates, once the owners hold its row gradients ``got`` (shard-major): the
        rows through the batch's tracked lookup, then the dense optimizer."""
        self.tables.update_looked_up(staged.looked_up, got)
        self._dense_step(dense)


@dataclass
class _Step:
    """What step i of the prioritized pipeline holds: batch i (``cur``), batch i+1 (``nxt``,
    None at the end of the data) and batch i+2 (``after``, its ids on their way); the flags
    exchange that tells the senders which of their ids of i and i+1 are collision rows (once
    batch i's written rows are known); the step's row plan across the replica groups."""

    cur: _Staged
    nxt: _Staged | None
    after: _Staged | None
    flags: object | None = None
    plan: object | None = None


class PrioritizedEmbeddingPipeline(OwnedTablesPipeline):
    """Collision rows first, exclusive rows early and overlapped (the schedule in the module's docstring).

    ``progress`` is the step top to bottom; what follows the backward is ``_finish`` (or
    ``_finish_last`` at the end of the data), the hooks a variant overrides."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._cur: _Staged | None = None
        self._next: _Staged | None = None
        self._deferred: _Deferred | None = None
        self._started = False
        self.collision_rates: list[float] = []
        self._marks: RowMarks | None = None  # a mark per local row (made at the first split)

    def progress(self, batches: Iterator):
        self._start(batches)
        if self._cur is None:
            raise StopIteration
        self._begin_step()
        step = _Step(self._cur, self._next, self._stage_after(batches))
        self._note_exchange(step.cur)
        self._before_forward(step)
        # Batch i's forward (its first read waits for its rows) and backward.
        loss, out, grads = self._forward_backward(step.cur.batch, partial(self._rows, step.cur),
                                                  between=partial(self._between_forward_and_backward, step))
        dense = self._reduce_dense()
        if step.after is not None:
            with self.timeline.span("id_wait"):
                step.after.pending.send()
        sent = step.cur.route.to_owner(grads)
        if step.nxt is None:
            # End of the data: nothing reads ahead, every row is updated now.
            route = step.cur.route
            with self.timeline.span("collision_wait"):
                got = self.transport.all_to_all_single(sent, route.send_counts, route.recv_counts).wait()
            self._finish_last(step, got, dense)
        else:
            self._finish(step, sent, dense)
        return out

    def _start(self, batches: Iterator) -> None:
        """At the first step: batch 1's rows looked up, batch 2's ids on their way."""
        if self._started:
            return
        self._started = True
        self._cur = self._stage(next(batches))
        self._cur.rows = self._lookup_all(self._cur, track=self.tracked)
        self._next = self._stage(next(batches, None))

    def _stage_after(self, batches: Iterator) -> _Staged | None:
        """The batch after next: its id exchange starts now and ends during this step."""
        return self._stage(next(batches, None), wait=False) if self._next is not None else None

    def _before_forward(self, step: _Step) -> None:
        """Batch i+1's rows split at their owners and the senders told which are which: what
        batch i writes (its own rows) is known before its forward, so the flags travel during it."""
        if step.nxt is not None:
            step.flags = self._split(step.cur, step.nxt, step.cur.route.ids)

    def _between_forward_and_backward(self, step: _Step) -> None:
        """Batch i-1's deferred gradients (their exchange overlapped the loading and the
        forward), before anything reads those rows: the lookup here is the step's first read.
        Then batch i+1's exclusive rows (final: batch i does not write them) are sent, to be
        waited for at batch i+1's first read."""
        self._apply_deferred()
        if step.nxt is not None:
            self._take_flags(step.cur, step.nxt, step.flags)
            self._send_exclusive_rows(step.nxt)

    def _finish(self, step: _Step, sent: torch.Tensor, dense: "DenseReduction") -> None:
        """After batch i's backward (``sent``: its row gradients, owner-major): the collision
        gradients first; the dense optimizer steps while they cross (as PEC's does beside its
        overlapping gradients: it reads nothing the exchange writes); the owners update those
        rows and send batch i+1's collision rows, now updated; then the rest of batch i's
        gradients, deferred to the next step (after: nothing large competes with the collision
        exchange for the wire or the CPU)."""
        cur, nxt = step.cur, step.nxt
        collision = self._send_collision_gradients(cur, sent)
        self._dense_step(dense)
        with self.timeline.span("collision_wait"):
            got = collision.wait()
        self.tables.update(self._on_device(_take(cur.route.ids, cur.owned_collide)), got)
        self._send_collision_rows(nxt)
        self._deferred = self._send_deferred(cur, sent)
        self._advance(step)
        if self._next is None:
            self.drain()  # the data ended: nothing is deferred past the last batch

    def _finish_last(self, step: _Step, got: torch.Tensor, dense: "DenseReduction") -> None:
        """The last batch of the data, ``got`` every gradient its owner receives: every row and
        the dense part updated now."""
        self._update(step.cur, got)
        self._dense_step(dense)
        self._advance(step)

    def _advance(self, step: _Step) -> None:
        """Batch i+1 becomes the batch in hand, batch i+2 the next."""
        self._cur, self._next = step.nxt, step.after

    # Parts ---------------------------------------------------------------------------------

    def _send_collision_gradients(self, cur: _Staged, sent: torch.Tensor):
        """Batch i's gradients of its collision rows to their owners, first (high lane)."""
        hot = cur.sent_collide
        return self.transport.all_to_all_single(sent.index_select(0, self._at(hot)), _per_owner(cur.route, hot),
                                                _per_rank(cur.route.recv_counts, cur.owned_collide), lane=self.high)

    def _split(self, cur: _Staged, nxt: _Staged, written: torch.Tensor):
        """Collision rows at this owner: those of batch i+1 in ``written`` (what batch i writes);
        the flags every sender needs, on their way (high lane)."""
        with self.timeline.span("id_wait"):
            nxt_route = nxt.wait_route()
        cur_route = cur.route
        if self._marks is None:
            self._marks = RowMarks(self.tables.weight.shape[0], self.tables.weight.device)
        split = self._marks.split(written, nxt_route.ids)
        cur.owned_collide, nxt.owned_collide = self._marks.among(split.collision, cur_route.ids, nxt_route.ids)
        self.collision_rates.append(self._note_rate(len(split.collision), len(split.collision) + len(split.exclusive)))
        # Per sender: flags for its batch-i ids, then for its batch-(i+1) ids.
        W = self.tables.world_size
        cur_parts = torch.split(cur.owned_collide, cur_route.recv_counts)
        nxt_parts = torch.split(nxt.owned_collide, nxt_route.recv_counts)
        flags = torch.cat([torch.cat([cur_parts[r], nxt_parts[r]]) for r in range(W)]).to(torch.uint8)
        back = [cur_route.send_counts[r] + nxt_route.send_counts[r] for r in range(W)]
        ins = [cur_route.recv_counts[r] + nxt_route.recv_counts[r] for r in range(W)]
        return self.transport.all_to_all_single(flags, ins, back, lane=self.high)

    def _take_flags(self, cur: _Staged, nxt: _Staged, handle) -> None:
        """Which of this rank's ids of batch i and i+1 (owner-major) are collision rows."""
        W = self.tables.world_size
        with self.timeline.span("flags_wait"):
            got = handle.wait().bool()
        sent = cur.route.send_counts
        parts = torch.split(got, [sent[r] + nxt.route.send_counts[r] for r in range(W)])
        cur.sent_collide = torch.cat([parts[r][:sent[r]] for r in range(W)])
        nxt.sent_collide = torch.cat([parts[r][sent[r]:] for r in range(W)])
        # This step's collision exchange, what must cross between batch i's backward and batch
        # i+1's forward: batch i's gradients of the rows batch i+1 reads, then those rows to
        # batch i+1's readers (averaged over the ranks, one rank's share, as exchange_bytes).
        remote = self._remote(cur, cur.sent_collide) + self._remote(nxt, nxt.sent_collide)
        self.timeline.note("collision_bytes", remote * self.row_bytes)

    def _send_exclusive_rows(self, nxt: _Staged) -> None:
        """Batch i+1's exclusive rows, looked up now, to their readers (normal lane); the lookup
        is tracked (its backward applies batch i+1's deferred gradients) where the pipeline
        updates the rows (``tracked``)."""
        route, cold = nxt.route, ~nxt.owned_collide
        every = bool(cold.all())
        ins, outs = _per_rank(route.recv_counts, cold), _per_owner(nxt.route, ~nxt.sent_collide)
        # On the side stream, after this step's deferred update (on the compute stream):
        with self.streams.on(self.side), self.timeline.device_span("exclusive_send", self.side):
            self.streams.hand_over(route.device_ids, self.side)
            ids = route.device_ids if every else self._on_device(_take(route.ids, cold))
            looked_up = self.tables.lookup(ids, track=self.tracked)
            nxt.exclusive = self.transport.all_to_all_single(looked_up.detach(), ins, outs, lane=NORMAL)
        nxt.looked_up = looked_up if self.tracked else None
        nxt.left_out = None if every else nxt.owned_collide

    def _send_collision_rows(self, nxt: _Staged) -> None:
        """Batch i+1's collision rows, looked up now (after batch i's update), to their readers."""
        hot = nxt.owned_collide
        ins, outs = _per_rank(nxt.route.recv_counts, hot), _per_owner(nxt.route, nxt.sent_collide)
        # On the side stream, after batch i's update (on the compute stream):
        with self.streams.on(self.side), self.timeline.device_span("collision_send", self.side):
            rows = self.tables.lookup(self._on_device(_take(nxt.route.ids, hot)))
            nxt.collision = self.transport.all_to_all_single(rows, ins, outs, lane=self.high)

    def _rows(self, staged: _Staged) -> torch.Tensor:
        """The batch's rows in batch order: the exclusive and the collision rows, waited for now."""
        if staged.rows is None:
            with self.timeline.span("exclusive_wait"):
                cold = staged.exclusive if isinstance(staged.exclusive, torch.Tensor) else self._wait(staged.exclusive)
            with self.timeline.span("collision_wait"):
                hot = self._wait(staged.collision)
            hot_at = staged.sent_collide
            if not hot.numel():
                owner_major = cold
            else:
                owner_major = cold.new_empty((len(hot_at), cold.shape[1]))
                owner_major.index_copy_(0, self._at(~hot_at), cold)
                owner_major.index_copy_(0, self._at(hot_at), hot)
            staged.rows = staged.route.to_batch(owner_major)
            staged.exclusive = staged.collision = None
        return staged.rows

    def _update(self, staged: _Staged, got: torch.Tensor) -> None:
        """Apply ``got`` (a gradient for every id the batch sent here, shard-major): through the
        batch's tracked lookup, and the rows it does not cover (the collision rows of the step
        before, a disjoint set: the fused optimizer's result is the same as in one call) looked up
        again."""
        if staged.left_out is None:
            self.tables.update_looked_up(staged.looked_up, got)
            return
        self.tables.update_looked_up(staged.looked_up, got.index_select(0, self._at(~staged.left_out)))
        rest = _positions(staged.left_out)
        self.tables.update(self._on_device(staged.route.ids.index_select(0, rest)), got.index_select(0, self._on_device(rest)))

    def _all_gradients(self, cur: _Staged, hot_got: torch.Tensor, deferred: "_Deferred") -> torch.Tensor:
        """Every gradient batch i's owner receives, as ``sync`` receives them (shard-major): the
        deferred part, then the collision rows in their places."""
        got = self._deferred_gradients(deferred)
        if hot_got.numel():
            got.index_copy_(0, self._at(cur.owned_collide), hot_got)
        return got

    def _deferred_gradients(self, deferred: "_Deferred") -> torch.Tensor:
        """What arrived of a deferred exchange, one row per id received (zero for the collision rows)."""
        with self.timeline.span("exclusive_wait"):
            got = self._wait(deferred.handle)
        if deferred.positions is None:
            return got
        full = got.new_zeros((len(deferred.staged.route.ids), got.shape[1]))
        full.index_copy_(0, deferred.positions, got)
        return full

    def _send_deferred(self, cur: _Staged, sent: torch.Tensor) -> "_Deferred":
        """Send batch i's gradients other than the collision rows' (normal lane, applied next step).

        Between a sender and an owner with few collision rows among the ids of the pair (at most
        half), the whole block goes, its collision rows zeroed: the owner applies it as it comes,
        and a zero row leaves its row as the collision update made it. With more, only the other
        rows go, and the owner puts them in place. Both ends count the pair's collision rows alike.
        """
        route, W = cur.route, self.tables.world_size
        hot_sent = _per_owner(route, cur.sent_collide)
        hot_owned = _per_rank(route.recv_counts, cur.owned_collide)
        whole_out = [2 * h <= n for h, n in zip(hot_sent, route.send_counts)]
        whole_in = [2 * h <= n for h, n in zip(hot_owned, route.recv_counts)]
        outs = [n if w else n - h for n, h, w in zip(route.send_counts, hot_sent, whole_out)]
        ins = [n if w else n - h for n, h, w in zip(route.recv_counts, hot_owned, whole_in)]
        # The sender's payload: whole blocks with zeroed collision rows, or the other rows alone.
        whole = torch.tensor(whole_out)[route.owners]
        zero = cur.sent_collide & whole
        keep = ~cur.sent_collide | whole
        # On the side stream, after the backward that made ``sent``:
        with self.streams.on(self.side), self.timeline.device_span("deferred_send", self.side):
            self.streams.hand_over(sent, self.side)
            if bool(zero.any()):
                sent.index_fill_(0, self._at(zero), 0.0)
            payload = sent if bool(keep.all()) else sent.index_select(0, self._at(keep))
            handle = self.transport.all_to_all_single(payload, outs, ins, lane=NORMAL)
        # Where the owner puts what arrives among the ids it received (None: as it comes).
        sources = torch.repeat_interleave(torch.arange(W), torch.tensor(route.recv_counts))
        placed = ~cur.owned_collide | torch.tensor(whole_in, dtype=torch.bool)[sources]
        return _Deferred(handle, cur, None if bool(placed.all()) else self._at(placed))

    def _wait(self, handle) -> torch.Tensor:
        """The result of an exchange issued on the side stream, for the compute stream."""
        return self.streams.take(handle.wait(), self.side)

    def _note_rate(self, collision: int, read: int) -> float:
        """This owner's collision rows / rows read; the step's record gets both counts."""
        self.timeline.note("collision_rows", collision)
        self.timeline.note("read_rows", read)
        return collision / read if read else 0.0

    def _apply_deferred(self) -> None:
        if self._deferred is not None:
            deferred, self._deferred = self._deferred, None
            self._update(deferred.staged, self._deferred_gradients(deferred))

    def drain(self) -> None:
        """Apply every deferred update: the tables then hold what synchronous training would,
        for whatever reads them next on the compute stream (evaluation, a checkpoint)."""
        self._apply_deferred()
        self.streams.wait_for(self.side)


PIPELINES = {"sync": SyncEmbeddingPipeline, "prioritized": PrioritizedEmbeddingPipeline}
"""The pipelines over FreeScale's own tables, by ``train.pipeline``."""


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Where host ``mask`` is true."""
    return mask.nonzero().squeeze(1)


def _take(rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The host rows ``mask`` keeps, in order (a gather by index: faster than boolean indexing)."""
    return rows.index_select(0, _positions(mask))


def _per_owner(route: Route, mask: torch.Tensor) -> list[int]:
    """How many of this rank's sent ids (owner-major) that ``mask`` keeps go to each owner."""
    return counts_by(route.owners[mask], len(route.send_counts))


def _per_rank(counts: list[int], mask: torch.Tensor) -> list[int]:
    """How many of the ids received (shard-major, ``counts`` from each rank) ``mask`` keeps, per rank."""
    return [int(part.sum()) for part in torch.split(mask, counts)]
