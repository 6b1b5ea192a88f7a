"""``freescale verify``: the prioritized pipeline against synchronous updates, bit for bit.

The same data (the experiment's source, balancer and all) is trained twice on the same ranks,
over the same module: once with ``train.pipeline: sync`` and once with ``prioritized``. After
N steps every embedding row, the embedding optimizer's state, every dense parameter and the
dense optimizer's state are compared on every rank, and so is each step's loss.

It runs on the run's device (``run.device``, backend ``train.backend``; on CPU, gloo). On a GPU
the same kernels run in the same order in both pipelines, but the verdict can be asked to hold
within a tolerance (``--tolerance``) rather than bit for bit.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from freescale import distributed
from freescale.balance.balancer import build_balancer
from freescale.config import ExperimentConfig
from freescale.data.loader import BatchLoader
from freescale.embedding.pipeline import build_owned_model
from freescale.model.sharding import build_dense_optimizer
from freescale.profile.timeline import NullTimeline
from freescale.train.pipelines import build_pipeline
from freescale.train.trainer import read_inputs

MODES = ("sync", "prioritized")


@dataclass
class Verdict:
    steps: int
    losses: dict[str, list[float]]
    """Per mode, each step's loss, the mean over the replica's ranks."""
    step_diffs: list[float]
    """Per step, the largest loss difference on any rank."""
    state_diffs: dict[str, float] = field(default_factory=dict)
    """Per kind of state, the largest absolute difference on any rank."""
    collision_rate: float = 0.0
    identical: bool = False
    device: str = "cpu"

    def within(self, tolerance: float) -> bool:
        """Bitwise identical, or every difference at most ``tolerance`` (when it is above 0)."""
        if self.identical:
            return True
        diffs = [*self.step_diffs, *self.state_diffs.values()]
        return tolerance > 0 and all(d <= tolerance for d in diffs)  # a NaN or an inf is never within


def snapshot(model, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's state by kind: embedding rows, their optimizer state, dense parameters, dense optimizer state."""
    tables = model.tables
    momentum = tables.momentum()
    dense_opt = {}
    for name, state in optimizer.state.items():
        for key, value in state.items():
            if torch.is_tensor(value):
                dense_opt[f"{name}.{key}"] = value.detach().clone()
    return {
        "embedding rows": {"weight": tables.weight.detach().clone()},
        "embedding optimizer state": {"momentum": momentum.detach().clone()} if momentum is not None else {},
        "dense parameters": {k: v.detach().clone() for k, v in model.task.state_dict().items()},
        "dense optimizer state": dense_opt,
    }


def _run(cfg: ExperimentConfig, mode: str, steps: int, topo, inputs, log, device: torch.device
         ) -> tuple[list[float], dict, list[float]]:
    torch.manual_seed(cfg.run.seed)
    loader = BatchLoader(inputs.train_source, batch_size=cfg.data.batch_size, rank=topo.rank,
                         world_size=topo.world_size, user_hash_size=cfg.model.user_hash_size)
    balancer = build_balancer(cfg.balance, cfg.transport, inputs.cost_model, group=topo.pg,
                              user_hash_size=cfg.model.user_hash_size)
    model = build_owned_model(cfg, num_items=inputs.train_source.num_items, max_uih_len=cfg.data.max_uih_len,
                              topology=topo, seed=cfg.run.seed, device=device,
                              side_layout=inputs.train_source.side_layout)
    optimizer = build_dense_optimizer(model.task, cfg.train)
    pipeline = build_pipeline(mode, model, optimizer, device, NullTimeline(), group=topo.pg,
                              transport_cfg=cfg.transport)
    try:
        batches = balancer.batches(loader.iter_samples())
        losses = []
        for step in range(1, steps + 1):
            losses.append(pipeline.progress(batches).loss.item())
            if topo.is_main and (step % max(1, steps // 4) == 0 or step == steps):
                log(f"{mode}: step {step}/{steps}")
        pipeline.drain()
        return losses, snapshot(model, optimizer), getattr(pipeline.inner, "collision_rates", [])
    finally:
        pipeline.close()
        balancer.close()


def compare(ref_losses: list[float], got_losses: list[float], ref_state: dict, got_state: dict
            ) -> tuple[list[float], dict[str, float], bool]:
    """This rank's comparison: per-step loss differences, the largest difference per kind of
    state, and whether everything is bitwise equal (a -0.0 is not 0.0; a NaN is never equal:
    two runs that diverged alike prove nothing)."""
    steps = [0.0 if a == b else (abs(a - b) if a == a and b == b else math.inf)
             for a, b in zip(ref_losses, got_losses)]
    equal = len(ref_losses) == len(got_losses) and all(
        struct.pack("<d", a) == struct.pack("<d", b) and not math.isnan(a) for a, b in zip(ref_losses, got_losses))
    worst: dict[str, float] = {}
    for kind, ref_part in ref_state.items():
        got_part = got_state[kind]
        if ref_part.keys() != got_part.keys():
            equal = False
        worst[kind] = 0.0
        for key, ref in ref_part.items():
            got = got_part.get(key)
            if got is None or got.shape != ref.shape or got.dtype != ref.dtype:
                equal, worst[kind] = False, math.inf
                continue
            # Bitwise: compare the bits, so that NaNs and signed zeros count.
            equal &= torch.equal(ref.reshape(-1).view(torch.uint8), got.reshape(-1).view(torch.uint8))
            equal &= not (ref.is_floating_point() and bool(ref.isnan().any()))
            if ref.numel():
                worst[kind] = max(worst[kind], float((ref.double() - got.double()).abs().nan_to_num(math.inf).max()))
    return steps, worst, equal


def verify(cfg: ExperimentConfig, steps: int, log=print) -> Verdict:
    """Train both ways on this job's ranks; every rank returns the same verdict."""
    device = distributed.resolve_device(cfg.run.device, int(os.environ.get("LOCAL_RANK", 0)))
    topo = distributed.init_distributed(device, cfg.train.backend)
    distributed.set_threads(cfg.run.threads, topo.local_world_size)
    inputs = read_inputs(cfg)
    runs = {mode: _run(cfg, mode, steps, topo, inputs, log, device) for mode in MODES}
    # The verdict's collectives carry host tensors (every group has a CPU backend: group_backend).
    (ref_losses, ref_state, _), (got_losses, got_state, rates) = runs["sync"], runs["prioritized"]

    local, state_diffs, equal = compare(ref_losses, got_losses, ref_state, got_state)
    kinds = list(state_diffs)
    diffs = [state_diffs[k] for k in kinds]
    verdict = torch.cat([torch.tensor(local, dtype=torch.float64), torch.tensor(diffs, dtype=torch.float64),
                         torch.tensor([0.0 if equal else 1.0], dtype=torch.float64)])
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=topo.pg)
    sums = torch.tensor([ref_losses, got_losses], dtype=torch.float64)
    dist.all_reduce(sums, group=topo.pg)
    sums /= topo.world_size
    rate = torch.tensor([sum(rates), float(len(rates))], dtype=torch.float64)
    dist.all_reduce(rate, group=topo.pg)
    n = len(ref_losses)
    return Verdict(
        steps=steps,
        losses={"sync": sums[0].tolist(), "prioritized": sums[1].tolist()},
        step_diffs=verdict[:n].tolist(),
        state_diffs=dict(zip(kinds, verdict[n:n + len(kinds)].tolist())),
        collision_rate=float(rate[0] / rate[1]) if rate[1] else math.nan,
        identical=bool(verdict[-1] == 0.0),
        device=device.type,
    )


def print_verdict(v: Verdict, tolerance: float = 0.0) -> None:
    print(f"{'step':>5} {'loss (sync)':>14} {'loss (prioritized)':>19} {'max |diff|':>11}")
    for i, (a, b, d) in enumerate(zip(v.losses["sync"], v.losses["prioritized"], v.step_diffs), 1):
        print(f"{i:>5} {a:>14.8f} {b:>19.8f} {d:>11.3g}")
    print(f"mean collision rate (per owner, per step): {100 * v.collision_rate:.1f}%")
    for kind, d in v.state_diffs.items():
        print(f"{kind + ':':<28} max |diff| {d:.3g}")
    print(f"on {v.device}: " + ("bitwise identical" if v.identical else "NOT bitwise identical"))
    if tolerance > 0 and not v.identical:
        print(f"within {tolerance:g}" if v.within(tolerance) else f"NOT within {tolerance:g}")
