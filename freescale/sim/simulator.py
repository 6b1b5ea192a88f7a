"""Project a shipped experiment to 8 .. 100,000 ranks: step time, bubbles, effective training time.

One step of synchronous training, for an experiment (the config as given, "freescale") and
for the same experiment with FreeScale's techniques off ("baseline": contiguous split,
TorchRec's ``sparse_dist`` pipeline, ``torch_dist``):

1. draw a global batch of ``data.batch_size * ranks`` samples from the experiment's length
   distribution (the synthetic generator, or the samples of a data file);
2. split it: contiguous slices (baseline) or ``balance.partition`` over the cost model's
   per-sample seconds (what the run-time balancer does);
3. each rank's compute ``w = compute_scale * sum(cost) * (1 + jitter) + step_overhead``, its
   cost's difference from the ranks' mean counted at ``imbalance_share``; the
   jitter is what the cost model does not predict (a normal of ``compute_jitter``, or a
   measured step's errors of its ranks, ``jitter_steps``, in units of the step's mean rank
   compute), so a balanced batch keeps a residual straggler;
   on a CPU box (``sim.cores_per_host``) a host's ranks and their other threads
   (``background_cpu_ms`` a step, plus ``overlap_cpu_us`` per overlapped collective)
   time-share its cores (processor sharing), so a rank's compute ends later than ``w`` while
   others run;
4. communication per step from the model's sizes (``comm_plan``): every exchange is an
   all-to-all or an all-reduce priced as latency + bytes / bandwidth over the intra-host and
   the cross-host link (the dense all-reduce never goes through the transport: it is priced
   on the backend's intra-host link, ``sim.backend_intra_*``, where that is set); what the
   pipeline overlaps with compute is exposed only beyond the compute it hides behind, the
   rest is exposed in full, but for exchanges that run at the same time (the dense
   all-reduce beside the gradients' exchange): the longer of them;
5. the step ends when the slowest rank's compute and the exposed communication are over.

The figures follow the profiler's definitions (``freescale.profile.bubbles``): a rank's own
compute is ``w`` (CPU time where cores are shared), its straggler bubble ``max(w) - w``, its
exposed communication ``T - max(w)``, its bubble fraction ``(T - w) / T``; straggler % is
the mean straggler bubble over the mean step time.

Effective training time under failures (committed-step time / wall time), with ``λ`` the
job's failure rate (ranks x ``failures_per_rank_hour``):

- synchronous restart: every failure stops the job for ``restart_s`` and loses half a
  checkpoint interval of work: ``1 / (1 + λ (restart_s + checkpoint_every_s / 2))``;
- replica layer: the surviving replica groups stall ``replica_stall_s``; only the failed
  group's share of the job is lost until it rejoins:
  ``1 / (1 + λ (replica_stall_s + rejoin_s * group_ranks / ranks))``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np

from freescale.balance.cost import CostModel
from freescale.balance.partition import PARTITIONS
from freescale.config import ExperimentConfig, SimConfig
from freescale.progress import bar

INDEX_BYTES = 8  # an int64 id
VALUE_BYTES = 4  # an fp32 embedding value or gradient
SAMPLES_PER_DRAW = 4_000_000
"""Samples drawn per rank count at most (steps are cut to fit at the largest scales)."""
LENGTH_POOL = 1 << 16
"""Samples read from a data file to sample lengths from."""


# --------------------------------------------------------------------------------------------
# The experiment, as the simulator sees it
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    name: str
    pipeline: str
    partition: str  # "contiguous" when the balancer is off
    transport: str


def variants(cfg: ExperimentConfig) -> list[Variant]:
    """The baseline (techniques off) and the experiment as configured."""
    freescale = Variant("freescale", cfg.train.pipeline, cfg.balance.partition if cfg.balance.enable else "contiguous",
                        cfg.transport.kind)
    return [Variant("baseline", "sparse_dist", "contiguous", "torch_dist"), freescale]


@dataclass(frozen=True)
class Exchange:
    """One exchange of a step: ``bytes_per_token`` per UIH/candidate token of the rank (plus
    ``bytes_per_sample`` per sample and ``fixed_bytes``), in ``messages`` collectives (each
    paying the latency), overlapped with compute or not."""

    name: str
    kind: str  # "all_to_all" | "all_reduce"
    bytes_per_token: float = 0.0
    bytes_per_sample: float = 0.0
    fixed_bytes: float = 0.0
    overlapped: bool = False
    messages: int = 1
    beside: str = ""  # runs at the same time as that (exposed) exchange: the longer of the two is exposed


def dense_parameters(cfg: ExperimentConfig) -> int:
    """Parameters all-reduced every step: the model's dense part (everything but its tables)."""
    import torch

    from freescale.model.seqrec import SeqRecModel, task_settings

    model = SeqRecModel(cfg.model, cfg.embedding, num_items=1, **task_settings(cfg),
                        device=torch.device("meta"))
    return sum(p.numel() for p in model.task.parameters())


def comm_plan(cfg: ExperimentConfig, variant: Variant) -> list[Exchange]:
    """The collectives of one training step of ``variant``, with their sizes.

    TorchRec's ``sparse_dist``: the next batch's input dist (a splits all-to-all, then lengths
    and values per table) a step ahead; the rows of the sequence table and the pooled user
    rows forward, their gradients backward; the dense all-reduce. The prioritized pipeline:
    counts and ids a step ahead, the collision flags during the forward, the exclusive rows
    early and the collision rows after the update, both waited for at the next forward
    (overlapped); the collision gradients first and waited for in full (exposed), the other
    gradients deferred to the next step (overlapped). The balancer: an all-gather of sample sizes and the samples' all-to-all,
    prefetched with the next batch.
    """
    row = cfg.model.embedding_dim * VALUE_BYTES
    dense = dense_parameters(cfg) * VALUE_BYTES
    tables = 2 if cfg.model.user_features else 1
    user = [Exchange("user rows", "all_to_all", bytes_per_sample=row),
            Exchange("user grads", "all_to_all", bytes_per_sample=row)] if cfg.model.user_features else []
    plan = []
    if variant.partition != "contiguous":
        plan.append(Exchange("balancer samples", "all_to_all", bytes_per_token=INDEX_BYTES, bytes_per_sample=32,
                             overlapped=True, messages=2))
    if variant.pipeline == "prioritized":
        c = cfg.sim.collision_rate
        plan += [Exchange("ids", "all_to_all", bytes_per_token=INDEX_BYTES, overlapped=True, messages=2),
                 Exchange("collision flags", "all_to_all", bytes_per_token=1, overlapped=True),
                 Exchange("exclusive rows", "all_to_all", bytes_per_token=(1 - c) * row, overlapped=True),
                 Exchange("collision rows", "all_to_all", bytes_per_token=c * row, overlapped=True),
                 Exchange("collision grads", "all_to_all", bytes_per_token=c * row),
                 Exchange("exclusive grads", "all_to_all", bytes_per_token=(1 - c) * row, overlapped=True)]
    else:
        plan += [Exchange("ids", "all_to_all", bytes_per_token=2 * INDEX_BYTES, overlapped=True,
                          messages=1 + 2 * tables),
                 Exchange("rows", "all_to_all", bytes_per_token=row),
                 Exchange("grads", "all_to_all", bytes_per_token=row)]
    # The dense all-reduce starts as the backward ends (DDP's one bucket, or DenseReduction)
    # and runs beside the gradients' exchange, on the backend's own threads.
    grads = "collision grads" if variant.pipeline == "prioritized" else "grads"
    return plan + user + [Exchange("dense all-reduce", "all_reduce", fixed_bytes=dense, beside=grads)]


class LengthSampler:
    """Draws (UIH length, candidate count) pairs from the experiment's data."""

    def __init__(self, cfg: ExperimentConfig, seed: int = 0) -> None:
        from freescale.data.loader import build_sources

        source, _ = build_sources(cfg.data, cfg.run.seed, task=cfg.task)
        n = source.num_samples or LENGTH_POOL * 16
        rng = np.random.default_rng(seed)
        positions = rng.choice(n, size=min(n, LENGTH_POOL), replace=False)
        if hasattr(source, "lengths_at"):  # (the synthetic stream: no items drawn)
            lengths, candidates = source.lengths_at(np.sort(positions))
        else:
            samples = source.samples_at(np.sort(positions))
            lengths, candidates = samples.uih_lengths, samples.cand_counts
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.candidates = np.asarray(candidates, dtype=np.int64)
        self.source = cfg.data.source

    def draw(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        pick = rng.integers(0, len(self.lengths), size=n)
        return self.lengths[pick], self.candidates[pick]


# --------------------------------------------------------------------------------------------
# Pieces of one step
# --------------------------------------------------------------------------------------------


def processor_sharing(work: np.ndarray, cores: int) -> np.ndarray:
    """When each of a host's ranks finishes ``work`` CPU-seconds on ``cores`` shared cores.

    Every running rank gets ``min(1, cores / running)`` of a core; as ranks finish, the others
    speed up. ``cores >= len(work)`` (or 0) is no sharing.
    """
    work = np.asarray(work, dtype=np.float64)
    n = len(work)
    if cores <= 0 or cores >= n:
        return work.copy()
    order = np.argsort(work, kind="stable")
    finish = np.empty(n)
    t, done = 0.0, 0.0
    for i, r in enumerate(order):
        rate = min(1.0, cores / (n - i))
        t += (work[r] - done) / rate
        done = work[r]
        finish[r] = t
    return finish


def _host_finish(work: np.ndarray, sim: SimConfig, overlapped_messages: int = 0) -> np.ndarray:
    """When a host's ranks finish their compute, sharing its cores with their other threads:
    ``background_cpu_ms`` each, and ``overlap_cpu_us`` per overlapped collective."""
    background = np.full(len(work), sim.background_cpu_ms / 1e3 + 1e-6 * sim.overlap_cpu_us * overlapped_messages)
    return processor_sharing(np.concatenate([work, background]), sim.cores_per_host)[:len(work)]


def _hosts(ranks: int, sim: SimConfig) -> tuple[int, int]:
    g = min(ranks, sim.ranks_per_host)
    return g, math.ceil(ranks / g)


def _latency(ranks: int, sim: SimConfig) -> float:
    g, hosts = _hosts(ranks, sim)
    rounds_in = max(1, math.ceil(math.log2(g))) if g > 1 else 0
    rounds_out = max(1, math.ceil(math.log2(hosts))) if hosts > 1 else 0
    return 1e-6 * (rounds_in * sim.intra_latency_us + rounds_out * sim.inter_latency_us)


def all_to_all_s(bytes_per_rank: float, ranks: int, sim: SimConfig, messages: int = 1) -> float:
    """``messages`` all-to-alls moving ``bytes_per_rank`` in all out of (and into) the busiest
    rank, spread evenly over the peers."""
    if ranks <= 1:
        return 0.0
    g, _ = _hosts(ranks, sim)
    intra = bytes_per_rank * (g - 1) / ranks / (sim.intra_bandwidth_gbs * 1e9)
    inter = bytes_per_rank * (ranks - g) / ranks / (sim.inter_bandwidth_gbs * 1e9)
    return messages * _latency(ranks, sim) + max(intra, inter)


def backend_link(sim: SimConfig) -> SimConfig:
    """``sim`` with the intra-host link of torch.distributed's backend (``backend_intra_*``, where set)."""
    return dataclasses.replace(sim, intra_bandwidth_gbs=sim.backend_intra_bandwidth_gbs or sim.intra_bandwidth_gbs,
                               intra_latency_us=sim.backend_intra_latency_us or sim.intra_latency_us)


def all_reduce_s(nbytes: float, ranks: int, sim: SimConfig) -> float:
    """A hierarchical all-reduce on the backend's link (``backend_link``): reduce-scatter and
    all-gather in the host, all-reduce of a host's share across hosts."""
    if ranks <= 1:
        return 0.0
    sim = backend_link(sim)
    g, hosts = _hosts(ranks, sim)
    intra = 2 * nbytes * (g - 1) / g / (sim.intra_bandwidth_gbs * 1e9)
    inter = 2 * (nbytes / g) * (hosts - 1) / hosts / (sim.inter_bandwidth_gbs * 1e9)
    return 2 * _latency(ranks, sim) + intra + inter


def effective_training_time(ranks: int, sim: SimConfig) -> dict:
    """Committed-step time / wall time under failures: synchronous restart vs the replica layer."""
    rate = sim.failures_per_rank_hour * ranks / 3600.0
    group = min(ranks, sim.replica_ranks or sim.ranks_per_host)
    sync = 1.0 / (1.0 + rate * (sim.restart_s + sim.checkpoint_every_s / 2))
    replica = 1.0 / (1.0 + rate * (sim.replica_stall_s + sim.rejoin_s * group / ranks))
    hours = math.inf if rate == 0 else 1.0 / rate / 3600.0
    return {"sync_restart": sync, "replica_layer": replica, "hours_between_failures": hours}


# --------------------------------------------------------------------------------------------
# Steps
# --------------------------------------------------------------------------------------------


@dataclass
class StepFigures:
    step_ms: float
    bubble_fraction: float
    straggler_pct: float
    exposed_comm_ms: float
    samples_per_s: float
    imbalance: float


def step_timings(cfg: ExperimentConfig, variant: Variant, ranks: int, model: CostModel, sampler: LengthSampler,
                 seed: int = 0, steps: int | None = None, split_model: CostModel | None = None):
    """Per simulated step: its time ``T`` (s) and every rank's own compute ``w`` (s, [ranks]).

    ``model`` prices the samples; the balancer splits them by ``split_model`` (the cost model
    its run uses; default ``model``), so a balancer whose model is off leaves what it mispredicts.
    """
    sim = cfg.sim
    rng = np.random.default_rng([seed, ranks])
    batch = cfg.data.batch_size
    steps = max(1, min(steps or sim.steps, SAMPLES_PER_DRAW // (batch * ranks)))
    split = PARTITIONS[variant.partition]
    plan = comm_plan(cfg, variant)
    g, hosts = _hosts(ranks, sim)
    overlapped_messages = sum(ex.messages for ex in plan if ex.overlapped)
    jitter = [np.asarray(errors, dtype=np.float64) for errors in sim.jitter_steps if errors]
    for _ in range(steps):
        lengths, cands = sampler.draw(rng, batch * ranks)
        predicted = model.cost(lengths, cands)
        owner = np.empty(len(lengths), dtype=np.int64)
        by = predicted if split_model is None else split_model.cost(lengths, cands)
        for r, part in enumerate(split(by, ranks)):
            owner[part] = r
        cost = np.bincount(owner, predicted, ranks)
        cost = cost.mean() + sim.imbalance_share * (cost - cost.mean())
        if jitter:  # measured steps' errors, in units of the step's mean rank compute
            picked = np.concatenate([jitter[i] for i in rng.integers(0, len(jitter), -(-ranks // min(map(len, jitter))))])
            cost = cost + cost.mean() * rng.permutation(picked)[:ranks]
        else:
            cost = cost * (1.0 + sim.compute_jitter * rng.standard_normal(ranks))
        w = np.maximum(sim.compute_scale * cost, 0.0)
        w += sim.step_overhead_ms / 1e3
        tokens = np.bincount(owner, (lengths + cands).astype(np.float64), ranks)
        counts = np.bincount(owner, minlength=ranks).astype(np.float64)
        overlapped, exposed = 0.0, {}
        for ex in plan:
            nbytes = float(np.max(ex.bytes_per_token * tokens + ex.bytes_per_sample * counts)) + ex.fixed_bytes
            t = (all_to_all_s(nbytes, ranks, sim, ex.messages) if ex.kind == "all_to_all"
                 else ex.messages * all_reduce_s(nbytes, ranks, sim))
            if ex.overlapped:
                overlapped += t
            else:
                key = ex.beside or ex.name
                exposed[key] = max(exposed.get(key, 0.0), t)
        exposed_comm = sum(exposed.values())
        if variant.transport == "torch_dist" and sim.cores_per_host == 0:
            w_wall = w + sim.sm_contention * np.minimum(overlapped, w)  # SM-based copies slow the kernels they overlap
        else:
            w_wall = w
        if sim.cores_per_host:
            finish = np.concatenate([_host_finish(w_wall[h * g:(h + 1) * g], sim, overlapped_messages) for h in range(hosts)])
        else:
            finish = w_wall
        exposed_comm += max(0.0, overlapped - float(np.min(w_wall)))  # what the compute cannot hide
        yield float(np.max(finish)) + exposed_comm, w


def simulate_steps(cfg: ExperimentConfig, variant: Variant, ranks: int, model: CostModel,
                   sampler: LengthSampler, seed: int = 0, steps: int | None = None,
                   split_model: CostModel | None = None) -> StepFigures:
    """Means over ``steps`` simulated global batches of ``variant`` on ``ranks`` ranks."""
    T_all, bubble, straggler, exposed, imbalance = [], [], [], [], []
    for T, w in step_timings(cfg, variant, ranks, model, sampler, seed, steps, split_model):
        T_all.append(T)
        bubble.append(float(np.mean((T - w) / T)))
        straggler.append(float(np.mean(np.max(w) - w)))
        exposed.append(T - float(np.max(w)))
        imbalance.append(float(np.max(w) / np.mean(w)))
    mean_T = float(np.mean(T_all))
    return StepFigures(step_ms=1e3 * mean_T, bubble_fraction=float(np.mean(bubble)),
                       straggler_pct=100.0 * float(np.mean(straggler)) / mean_T,
                       exposed_comm_ms=1e3 * float(np.mean(exposed)),
                       samples_per_s=cfg.data.batch_size * ranks / mean_T, imbalance=float(np.mean(imbalance)))


def project(cfg: ExperimentConfig, model: CostModel, ranks: list[int] | None = None, log=print) -> dict:
    """Every rank count of ``sim.ranks`` (or ``ranks``), both variants, and effective training time."""
    sampler = LengthSampler(cfg, seed=cfg.run.seed)
    rows = []
    counts = list(ranks or cfg.sim.ranks)
    progress = bar(total=len(counts), desc="simulate", unit="rank count")
    for R in counts:
        t0 = time.perf_counter()
        row = {"ranks": R, "hosts": _hosts(R, cfg.sim)[1]}
        for v in variants(cfg):
            row[v.name] = dataclasses.asdict(simulate_steps(cfg, v, R, model, sampler, seed=cfg.run.seed))
        b, f = row["baseline"], row["freescale"]
        row["ratios"] = {k: (f[k] / b[k] if b[k] else None) for k in b}
        if cfg.sim.failures_per_rank_hour > 0:
            row["effective_training_time"] = effective_training_time(R, cfg.sim)
        rows.append(row)
        progress.update()
        log(f"[simulate] {R} ranks: baseline {b['step_ms']:.1f} ms/step, freescale {f['step_ms']:.1f} ms/step "
            f"({time.perf_counter() - t0:.1f} s)")
    progress.close()
    return {"variants": [dataclasses.asdict(v) for v in variants(cfg)], "data": sampler.source,
            "sim": dataclasses.asdict(cfg.sim), "cost_model": {k: getattr(model, k) for k in "abcd"}, "rows": rows}


def format_table(result: dict) -> str:
    """The projection as a text table (one line per rank count)."""
    head = (f"{'ranks':>7} {'step ms':>17} {'bubble frac':>13} {'straggler %':>13} {'exposed ms':>15} "
            f"{'samples/s x':>11} {'ETT sync/replica':>17}")
    lines = [head, "-" * len(head)]
    for row in result["rows"]:
        b, f = row["baseline"], row["freescale"]
        ett = row.get("effective_training_time")
        ett_s = f"{ett['sync_restart']:.3f} / {ett['replica_layer']:.3f}" if ett else "-"
        lines.append(f"{row['ranks']:>7} {b['step_ms']:>8.1f}->{f['step_ms']:<8.1f} "
                     f"{b['bubble_fraction']:>6.3f}->{f['bubble_fraction']:<6.3f} "
                     f"{b['straggler_pct']:>6.1f}->{f['straggler_pct']:<6.1f} "
                     f"{b['exposed_comm_ms']:>7.2f}->{f['exposed_comm_ms']:<7.2f} "
                     f"{f['samples_per_s'] / b['samples_per_s']:>11.3f} {ett_s:>17}")
    lines.append("(baseline -> freescale; projections from the cost model and sim.* parameters, not measurements)")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Bubble fraction and straggler % (baseline, freescale) and effective training time
    (synchronous restart, replica layer) against the rank count, as one PNG."""
    from freescale.profile.report import _pyplot, _save_fig

    plt = _pyplot()
    ranks = [r["ranks"] for r in result["rows"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, style in (("baseline", "o--"), ("freescale", "o-")):
        left.plot(ranks, [r[name]["bubble_fraction"] for r in result["rows"]], style, label=f"{name} bubble fraction")
        left.plot(ranks, [r[name]["straggler_pct"] / 100 for r in result["rows"]], style, alpha=0.5,
                  label=f"{name} straggler share")
    left.set(xscale="log", xlabel="ranks", ylabel="share of the step", title="Bubbles per step (projection)")
    left.legend(fontsize=8)
    if all("effective_training_time" in r for r in result["rows"]):
        for key, style in (("sync_restart", "o--"), ("replica_layer", "o-")):
            right.plot(ranks, [r["effective_training_time"][key] for r in result["rows"]], style,
                       label=key.replace("_", " "))
        right.set(xscale="log", xlabel="ranks", ylabel="committed-step time / wall time", ylim=(0, 1.02),
                  title="Effective training time under failures (projection)")
        right.legend(fontsize=8)
    fig.tight_layout()
    _save_fig(fig, path)
