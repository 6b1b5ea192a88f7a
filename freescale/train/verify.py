"""``freescale verify``: two pipelines trained on the same data, compared bit for bit.

The same data (the experiment's source, balancer and all) is trained twice on the same ranks:
run A with ``train.pipeline`` A and run B with ``train.pipeline`` B, by default ``sync`` and
``prioritized`` (FreeScale's own tables updated synchronously, and the prioritized schedule
over the same tables). Any two pipelines over the same kind of tables can be
compared (``sparse_dist`` and ``base`` over TorchRec's). Run B may also take config overrides
of its own, which asks whether a setting changes the numbers.

After N steps (and a drain: what a pipeline still owes the tables is applied) each rank's
state is compared: the embedding rows it holds, their fused optimizer's state, every dense
parameter and the dense optimizer's state (the table kind says where its rows live:
``freescale.train.tables``), and so is each step's loss. A difference is found on every rank;
the first one reported is the earliest step whose loss differs on any rank, or else the first
rank's first differing value of the state.

It runs on the run's device (``run.device``, backend ``train.backend``; on CPU, gloo). On a GPU
the same kernels run in the same order in both pipelines, but the verdict can be asked to hold
within a tolerance (``--tolerance``) rather than bit for bit. Not under the replica layer: the
two runs share the job's ranks, with no replica groups.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
from torchrec.optim.optimizers import in_backward_optimizer_filter

from freescale import distributed
from freescale.balance.balancer import build_balancer
from freescale.config import ExperimentConfig
from freescale.data.loader import BatchLoader
from freescale.profile.timeline import NullTimeline
from freescale.train.pairs import check_runs
from freescale.train.tables import OWNED_TABLES
from freescale.train.trainer import read_inputs
from freescale.train.training import build_training, check_device

DEFAULT_PIPELINES = ("sync", "prioritized")
State = dict[str, dict[str, torch.Tensor]]
"""This rank's state by kind (embedding rows, embedding optimizer state, dense parameters,
dense optimizer state), each a mapping of names to tensors."""


class Difference(NamedTuple):
    """The first thing two runs disagree on, on one rank: a step's loss, or a value of the state.
    Values are text (Python's ``repr`` of a float is exact, so two different values never print alike)."""

    rank: int
    step: int
    """The step whose loss differs (0: the losses agree, the state does not)."""
    kind: str = ""
    """The kind of state ("embedding rows", ...)."""
    key: str = ""
    index: int = -1
    """The flat index of the value in the key's tensor (-1: the key is missing, or its shape or dtype differs)."""
    a: str = ""
    b: str = ""

    def line(self, names: tuple[str, str]) -> str:
        where = f"step {self.step}'s loss" if self.step else f"{self.kind} {self.key}" + (
            f" [flat index {self.index}]" if self.index >= 0 else "")
        return f"first difference: {where} on rank {self.rank}: {self.a} ({names[0]}) against {self.b} ({names[1]})"


class Comparison(NamedTuple):
    """One rank's comparison of two runs."""

    step_diffs: list[float]
    """Per step, the loss difference (inf where either is a NaN)."""
    state_diffs: dict[str, float]
    """Per kind of state, the largest absolute difference (inf: a key missing, reshaped or NaN)."""
    first: Difference | None
    """The first difference, None when everything is bitwise equal."""

    @property
    def equal(self) -> bool:
        return self.first is None


def _same_bits(a: float, b: float) -> bool:
    """Bitwise equal and not a NaN: two runs that diverged alike prove nothing."""
    return struct.pack("<d", a) == struct.pack("<d", b) and not math.isnan(a)


def _differing(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """Per element (flat), whether the bits differ or the value is a NaN (-0.0 is not 0.0)."""
    size = ref.element_size()
    ref_flat, got_flat = ref.reshape(-1), got.reshape(-1)
    differs = (ref_flat.view(torch.uint8).reshape(-1, size) != got_flat.view(torch.uint8).reshape(-1, size)).any(dim=1)
    return differs | ref_flat.isnan() if ref.is_floating_point() else differs


def _value(t: torch.Tensor, index: int) -> str:
    return repr(t.reshape(-1)[index].item())


def _described(t: torch.Tensor | None) -> str:
    return "absent" if t is None else f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"


def compare(ref_losses: list[float], got_losses: list[float], ref_state: State, got_state: State,
            rank: int = 0) -> Comparison:
    """Run B's losses and state (``got``) against run A's (``ref``), on rank ``rank``: bitwise,
    so that a -0.0 is not 0.0, and a NaN is never equal (not even to the same NaN)."""
    steps = [0.0 if a == b else (abs(a - b) if a == a and b == b else math.inf) for a, b in zip(ref_losses, got_losses)]
    first = None
    for step, (a, b) in enumerate(zip(ref_losses, got_losses), 1):
        if not _same_bits(a, b):
            first = Difference(rank, step, a=repr(a), b=repr(b))
            break
    if first is None and len(ref_losses) != len(got_losses):
        first = Difference(rank, min(len(ref_losses), len(got_losses)) + 1, a=f"{len(ref_losses)} steps",
                           b=f"{len(got_losses)} steps")
    worst: dict[str, float] = {}
    for kind in [*ref_state, *(k for k in got_state if k not in ref_state)]:
        ref_part, got_part = ref_state.get(kind, {}), got_state.get(kind, {})
        worst[kind] = 0.0
        for key in [*ref_part, *(k for k in got_part if k not in ref_part)]:
            ref, got = ref_part.get(key), got_part.get(key)
            if ref is None or got is None or got.shape != ref.shape or got.dtype != ref.dtype:
                worst[kind] = math.inf
                first = first or Difference(rank, 0, kind, key, a=_described(ref), b=_described(got))
                continue
            if not ref.numel():
                continue
            worst[kind] = max(worst[kind], float((ref.double() - got.double()).abs().nan_to_num(math.inf).max()))
            if first is None:
                differs = _differing(ref, got).nonzero()
                if differs.numel():
                    i = int(differs[0])
                    first = Difference(rank, 0, kind, key, i, _value(ref, i), _value(got, i))
    return Comparison(steps, worst, first)


def earliest(differences: list[Difference | None]) -> Difference | None:
    """Of every rank's first difference: the earliest step whose loss differs (the lowest rank
    among equals), or else the first rank's difference in the state."""
    found = [d for d in differences if d is not None]
    by_step = [d for d in found if d.step]
    if by_step:
        return min(by_step, key=lambda d: (d.step, d.rank))
    return min(found, key=lambda d: d.rank) if found else None


@dataclass
class Verdict:
    steps: int
    losses: dict[str, list[float]]
    """Per pipeline (A, then B), each step's loss, the mean over the replica's ranks."""
    step_diffs: list[float]
    """Per step, the largest loss difference on any rank."""
    state_diffs: dict[str, float] = field(default_factory=dict)
    """Per kind of state, the largest absolute difference on any rank."""
    collision_rates: dict[str, float] = field(default_factory=dict)
    """Per pipeline that measures one (prioritized), the mean collision rate per owner and step."""
    identical: bool = False
    first: Difference | None = None
    """The first difference (None when identical)."""
    device: str = "cpu"

    @property
    def pipelines(self) -> tuple[str, str]:
        a, b = self.losses
        return a, b

    def within(self, tolerance: float) -> bool:
        """Bitwise identical, or every difference at most ``tolerance`` (when it is above 0)."""
        if self.identical:
            return True
        diffs = [*self.step_diffs, *self.state_diffs.values()]
        return tolerance > 0 and all(d <= tolerance for d in diffs)  # a NaN or an inf is never within


def snapshot(model, optimizer, tables=OWNED_TABLES) -> State:
    """This rank's state by kind: embedding rows and their optimizer's state (where ``tables``,
    the table kind, keeps them), dense parameters, dense optimizer state (by parameter name)."""
    dense = in_backward_optimizer_filter(tables.dense_module(model).named_parameters())
    dense_opt = {}
    for name, state in tables.dense_optimizer(optimizer).state_dict()["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value):
                dense_opt[f"{name}.{key}"] = value.detach().clone()
    return {
        **tables.embedding_state(model),
        "dense parameters": {name: p.detach().clone() for name, p in dense},
        "dense optimizer state": dense_opt,
    }


class Run(NamedTuple):
    losses: list[float]
    state: State
    collision_rates: list[float]


def _run(cfg: ExperimentConfig, steps: int, topo, inputs, log, device: torch.device) -> Run:
    name = cfg.train.pipeline
    torch.manual_seed(cfg.run.seed)
    loader = BatchLoader(inputs.train_source, batch_size=cfg.data.batch_size, rank=topo.rank,
                         world_size=topo.world_size, user_hash_size=cfg.model.user_hash_size)
    balancer = build_balancer(cfg.balance, cfg.transport, inputs.cost_model, group=topo.pg,
                              user_hash_size=cfg.model.user_hash_size)
    training = build_training(cfg, num_items=inputs.train_source.num_items, topology=topo, device=device,
                              side_layout=inputs.train_source.side_layout)
    pipeline = training.build_pipeline(device, NullTimeline(), group=topo.pg, replica=None)
    try:
        batches = balancer.batches(loader.iter_samples())
        losses = []
        for step in range(1, steps + 1):
            losses.append(pipeline.progress(batches).loss.item())
            if topo.is_main and (step % max(1, steps // 4) == 0 or step == steps):
                log(f"{name}: step {step}/{steps}")
        pipeline.drain()  # what the pipeline still owes the tables, applied before they are read
        state = snapshot(training.model, training.optimizer, training.pipeline_class.table_kind)
        return Run(losses, state, list(getattr(pipeline.inner, "collision_rates", [])))
    finally:
        pipeline.close()
        balancer.close()


def verify(a: ExperimentConfig, b: ExperimentConfig, steps: int, log=print) -> Verdict:
    """Train run ``a`` and run ``b`` (each its config's ``train.pipeline``) on this job's ranks;
    every rank returns the same verdict."""
    check_runs(a, b)
    device = distributed.resolve_device(a.run.device, int(os.environ.get("LOCAL_RANK", 0)))
    for cfg in (a, b):
        check_device(cfg, device)
    topo = distributed.init_distributed(device, a.train.backend)
    distributed.set_threads(a.run.threads, topo.local_world_size)
    inputs = [read_inputs(cfg) for cfg in (a, b)]  # (bad input in either fails before any training)
    ref, got = [_run(cfg, steps, topo, cfg_inputs, log, device) for cfg, cfg_inputs in zip((a, b), inputs)]
    names = (a.train.pipeline, b.train.pipeline)

    # The verdict's collectives carry host tensors (every group has a CPU backend: group_backend).
    mine = compare(ref.losses, got.losses, ref.state, got.state, rank=topo.rank)
    kinds = list(mine.state_diffs)
    worst = torch.tensor([*mine.step_diffs, *(mine.state_diffs[k] for k in kinds)], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=topo.pg)
    first = earliest(distributed.all_gather_object(mine.first, topo.pg))
    means = torch.tensor([ref.losses, got.losses], dtype=torch.float64)
    dist.all_reduce(means, group=topo.pg)
    means /= topo.world_size
    rates = torch.tensor([[sum(r.collision_rates), float(len(r.collision_rates))] for r in (ref, got)],
                         dtype=torch.float64)
    dist.all_reduce(rates, group=topo.pg)
    n = len(mine.step_diffs)
    return Verdict(
        steps=steps,
        losses={names[0]: means[0].tolist(), names[1]: means[1].tolist()},
        step_diffs=worst[:n].tolist(),
        state_diffs=dict(zip(kinds, worst[n:].tolist())),
        collision_rates={name: float(total / count) for name, (total, count) in zip(names, rates.tolist()) if count},
        identical=first is None,
        first=first,
        device=device.type,
    )


def print_verdict(v: Verdict, tolerance: float = 0.0) -> None:
    a, b = v.pipelines
    heads = (f"loss ({a})", f"loss ({b})")
    widths = [max(14, len(h)) for h in heads]
    print(f"{'step':>5} {heads[0]:>{widths[0]}} {heads[1]:>{widths[1]}} {'max |diff|':>11}")
    for i, (x, y, d) in enumerate(zip(v.losses[a], v.losses[b], v.step_diffs), 1):
        print(f"{i:>5} {x:>{widths[0]}.8f} {y:>{widths[1]}.8f} {d:>11.3g}")
    for name, rate in v.collision_rates.items():
        print(f"mean collision rate of {name} (per owner, per step): {100 * rate:.1f}%")
    for kind, d in v.state_diffs.items():
        print(f"{kind + ':':<28} max |diff| {d:.3g}")
    print(f"on {v.device}: " + ("bitwise identical" if v.identical else "NOT bitwise identical"))
    if v.first is not None:
        print(v.first.line(v.pipelines))
    if tolerance > 0 and not v.identical:
        print(f"within {tolerance:g}" if v.within(tolerance) else f"NOT within {tolerance:g}")
