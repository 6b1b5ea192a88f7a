"""The training loop.

``train(cfg)`` is the whole job on one rank: set-up in short sections, then a loop of a few
calls per step. It runs standalone (one rank) or under ``torchrun`` (one process per rank);
a replica layer passes the ``Topology`` of its replica, whose process group every collective
here runs on.

Inputs are read before anything is written (``read_inputs``): a bad data file, checkpoint or
cost model fails without leaving a run folder behind. Once the run folder exists, whatever the run opens (the
balancer's transport, the timeline, the ledger, the metrics log and its TensorBoard writer,
the garbage collector's schedule, the log file) is closed on the way out, on success and on
failure alike; a failure is logged with its traceback to the rank's log file and raised as a
``TrainingError`` naming the cause.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import json
import logging
import os
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from freescale import distributed
from freescale.balance.balancer import build_balancer
from freescale.balance.cost import CostModel, load_cost_model
from freescale.data.readahead import read_ahead
from freescale.config import ExperimentConfig, declared_faults, write_config
from freescale.data.loader import BatchLoader, SampleSource, build_sources, eval_batches
from freescale.distributed import Topology
from freescale.faults import build_faults
from freescale.ft.files import ReplicaFiles
from freescale.ft.replica import Restore, build_replica
from freescale.io import write_json_atomic
from freescale.logging import log_file_path, log_to_file, setup_logging
from freescale.model.flops import matmul_widths, training_flops
from freescale.model.side import side_specs
from freescale.profile import mfu
from freescale.profile.mfu import FlopsTally
from freescale.profile.peak import PEAK_FILE, matmul_peak
from freescale.profile.report import write_report
from freescale.profile.straggler import inject_delay
from freescale.profile.timeline import build_timeline
from freescale.train.checkpoint import Checkpointer, job_checkpoints, resolve_checkpoint, run_dir_of
from freescale.train.ledger import build_ledger
from freescale.data.features import label_names
from freescale.train.metrics import HeldOutMetrics, MetricsLog, read_metrics, require_tensorboard
from freescale.train.retrieval import evaluate_retrieval, retrieval_line
from freescale.train.pipelines import TrainPipeline
from freescale.train.state import DataCursor, RNGState, TrainerState, TrainingState
from freescale.train.training import build_training, check_device


class TrainingError(RuntimeError):
    """Training failed on this rank; the message names the cause, ``log_path`` holds the traceback."""

    def __init__(self, message: str, log_path: str) -> None:
        super().__init__(message)
        self.log_path = log_path


@dataclass
class StepWindow:
    """Losses, samples, training FLOPs and timing since the last log line."""

    losses: list = field(default_factory=list)
    samples: int = 0
    flops: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    def add(self, loss: torch.Tensor, samples: int, flops: float) -> None:
        self.losses.append(loss)
        self.samples += samples
        self.flops += flops

    def totals(self) -> torch.Tensor:
        """[sum of the losses, steps, samples, FLOPs] in float64, on the losses' device (the run's:
        a loss is read back only here, once per log line, and the sum is reduced where it is)."""
        losses = torch.stack(self.losses)
        counts = losses.new_tensor([float(len(self.losses)), float(self.samples), self.flops], dtype=torch.float64)
        return torch.cat([losses.sum().double().reshape(1), counts])


def train(cfg: ExperimentConfig, topology: Topology | None = None) -> dict:
    """Run (or resume) the experiment; returns the summary also written to summary.json."""
    # Processes, devices, logging.
    device = distributed.resolve_device(cfg.run.device, int(os.environ.get("LOCAL_RANK", 0)))
    check_device(cfg, device)
    if cfg.run.tensorboard:
        require_tensorboard()
    topo = topology or distributed.init_distributed(device, cfg.train.backend)
    if cfg.ft.enable:  # this job is one replica group of several
        topo = dataclasses.replace(topo, replica_id=cfg.ft.replica_id, num_replicas=cfg.ft.num_replicas)
    threads = distributed.set_threads(cfg.run.threads, topo.local_world_size)
    log = setup_logging(topo.replica_id, topo.rank)
    _quiet_third_party_logs()
    log.info(f"{topo.world_size} rank(s) on {device.type}, {threads} thread(s) per rank")

    # Inputs, before anything is written: a bad data file, checkpoint or cost model fails here.
    inputs = read_inputs(cfg)

    # Run folder: new, explicit, or the one being resumed; this rank's log file in it.
    run_dir = _prepare_run_dir(cfg, topo, inputs.resume_from)
    log_path = log_file_path(run_dir, topo.replica_id, topo.rank)
    with contextlib.ExitStack() as closing:
        closing.callback(log_to_file(log_path, topo.replica_id, topo.rank).close)
        log.info(f"run folder: {run_dir}")
        try:
            return _train(cfg, topo, device, threads, run_dir, inputs, closing, log)
        except Exception as e:
            log.error(f"training failed: {type(e).__name__}: {e}", exc_info=True, extra={"file_only": True})
            raise TrainingError(f"rank {topo.rank}: {type(e).__name__}: {e}", log_path) from e


@dataclass
class Inputs:
    """What a run reads before it writes anything."""

    train_source: SampleSource
    eval_source: SampleSource
    resume_from: str
    """The checkpoint folder to resume from ("" for a new run)."""
    cost_model: CostModel


def read_inputs(cfg: ExperimentConfig) -> Inputs:
    """The data sources, the checkpoint to resume and the cost model; raises on bad input (a side
    feature of ``model.side_features`` the source does not have included)."""
    train_source, eval_source = build_sources(cfg.data, cfg.run.seed, task=cfg.task)
    side_specs(cfg.model, train_source.side_layout)
    resume_from = resolve_checkpoint(cfg.checkpoint.resume) if cfg.checkpoint.resume else ""
    return Inputs(train_source, eval_source, resume_from, load_cost_model(cfg.balance.cost_model))


def _train(cfg: ExperimentConfig, topo: Topology, device: torch.device, threads: int, run_dir: str,
           inputs: Inputs, closing: contextlib.ExitStack, log: logging.Logger) -> dict:
    """Set-up and the loop; everything opened is registered on ``closing``."""
    group = topo.pg
    resume_from = inputs.resume_from

    # Data: this rank's slice of every global batch, and its share of the held-out samples.
    loader = BatchLoader(inputs.train_source, batch_size=cfg.data.batch_size, rank=topo.rank, world_size=topo.world_size,
                         user_hash_size=cfg.model.user_hash_size, shard=cfg.ft.replica_id if cfg.ft.enable else 0,
                         shards=cfg.ft.num_replicas if cfg.ft.enable else 1)
    held_out = eval_batches(inputs.eval_source, num_samples=cfg.data.eval_samples, batch_size=cfg.data.batch_size,
                            rank=topo.rank, world_size=topo.world_size, user_hash_size=cfg.model.user_hash_size)

    # Model and optimizer, for the tables the pipeline trains: TorchRec's (sharded and
    # materialized by DMP) or FreeScale's own (``freescale.train.tables``).
    torch.manual_seed(cfg.run.seed)
    training = build_training(cfg, num_items=inputs.train_source.num_items, topology=topo, device=device,
                              side_layout=inputs.train_source.side_layout)
    model, optimizer = training.model, training.optimizer

    # State that survives a restart; resume it from the checkpoint.
    trainer = TrainerState()
    cursor = DataCursor(loader, groups=cfg.ft.num_replicas if cfg.ft.enable else 1)
    state = TrainingState(model=model, optimizer=optimizer, trainer=trainer, data=cursor, rng=RNGState(topo.rank))
    checkpointer = Checkpointer(run_dir, cfg.checkpoint, rank=topo.rank, group=group)
    if resume_from:
        checkpointer.load(resume_from, state)
        log.info(f"resumed from {resume_from} at step {trainer.step}")

    # Profiling: per-step timelines (a NullTimeline when off), phase spans, straggler injection.
    timeline = build_timeline(cfg.profile, run_dir, rank=topo.rank, world_size=topo.world_size, threads=threads,
                              device=device, group=group)
    closing.callback(timeline.finish)
    inject_delay(training.dense_module, timeline, rank=topo.rank, ranks=cfg.profile.delay_ranks,
                 delay_ms=cfg.profile.delay_ms)

    # Efficiency: MFU is reported against the matmul peak measured (or cached) by the main rank,
    # stored with the run; each step's training FLOPs are counted from its host lengths.
    peak = distributed.broadcast_object(
        matmul_peak(device, matmul_widths(cfg.model), cfg.profile.peak_cache) if topo.is_main else None, group)
    if topo.is_main:
        write_json_atomic(os.path.join(run_dir, PEAK_FILE), dataclasses.asdict(peak))
    tally = FlopsTally()

    # Balancer: every global batch re-partitioned by cost (a NullBalancer keeps contiguous slices).
    balancer = build_balancer(cfg.balance, cfg.transport, inputs.cost_model, group=group,
                              user_hash_size=cfg.model.user_hash_size)
    closing.callback(balancer.close)
    if topo.is_main and cfg.balance.enable:
        balancer.cost_model.save(os.path.join(run_dir, "cost_model.json"))

    # The replica layer (a NullReplica when ft is off) and the pipeline. A group that has run
    # before settles its state with the others before it draws a batch: it catches up from a
    # live group that is ahead, or, when every group was lost, loads the job's newest checkpoint.
    faults = build_faults([f for _, f in declared_faults(cfg)], topo.rank, cfg.ft.replica_id if cfg.ft.enable else None,
                          run_dir)
    replica = build_replica(cfg, topo, state, training.dense_parameters(), training.dense_optimizer,
                            training.table_side(), faults, run_dir)
    closing.callback(replica.close)
    pipeline = training.build_pipeline(device, timeline, group=group, replica=replica)
    closing.callback(pipeline.close)
    if cfg.ft.enable and group_has_run_before(run_dir, group):
        replica.join(None if resume_from else Restore(
            step=newest_job_step(run_dir, group), load=lambda: _restore_newest(checkpointer, state, run_dir, log, group)))
    first_step = trainer.step

    # The logs, cut back to the state the loop starts from (what comes after is trained again).
    metrics = MetricsLog(run_dir, enabled=topo.is_main, start_step=trainer.step, tensorboard=cfg.run.tensorboard)
    closing.callback(metrics.close)
    ledger = build_ledger(cfg.train.ledger, run_dir, replica=topo.replica_id, rank=topo.rank,
                          keep_before=cursor.next_batch, position_after=loader.position_after)
    closing.callback(ledger.close)
    replica.on_contribute = lambda step, batch: ledger.entering(step, int(batch.batch_index), batch.sample_ids)

    # The loop. Python's collector runs on a schedule shared by all ranks: left to itself it
    # pauses one rank at a time, and every pause becomes a straggler bubble on the others.
    collector = GarbageCollector(cfg.train.gc_every)
    closing.callback(collector.close)
    samples = read_ahead(cursor.stream(), cfg.data.read_ahead)  # (decoded on a thread of its own)
    closing.callback(getattr(samples, "close", lambda: None))
    balanced = balancer.batches(samples)  # (balanced on the balancer's thread, when it is on)
    closing.callback(balanced.close)  # first: the balancer's thread may read samples to finish its window
    batches = timeline.timed_batches(balanced)
    window = StepWindow()
    started = time.perf_counter()
    aside = 0.0  # seconds of evaluations and checkpoints inside the loop
    while trainer.step < cfg.train.steps:
        faults.before_step(trainer.step + 1)
        timeline.begin_step(trainer.step + 1)
        out = pipeline.progress(batches)
        vote = pipeline.vote
        if not vote.stepped:
            continue  # rolled back: the same batch again
        trainer.step += 1
        flops = training_flops(training.task, out.uih_lengths, out.cand_counts) if vote.trained else 0.0
        timeline.note("train_flops", flops)
        timeline.end_step(trainer.step, out)
        collector.step(trainer.step)
        if vote.trained:  # (a group that caught up in this step trains its batch in the next)
            batch_index = out.batch_index.item()
            cursor.advance_past(batch_index)
            ledger.record(trainer.step, batch_index, out.sample_ids)
        replica.committed(trainer.step, cursor.next_batch, vote.trained)
        window.add(out.loss, len(out.sample_ids) if vote.trained else 0, flops)
        if _due(trainer.step, cfg.run.log_every, cfg.train.steps):
            window = _log_progress(trainer.step, window, metrics, log, group, peak.flop_per_s, tally)
        paused = time.perf_counter()
        if held_out and _due(trainer.step, cfg.train.eval_every, cfg.train.steps):
            metrics.write({"step": trainer.step, **_evaluate(pipeline, held_out, log, trainer.step, group, cfg,
                                                             inputs.train_source)})
        if _due(trainer.step, cfg.checkpoint.every, cfg.train.steps if cfg.checkpoint.at_end else 0):
            pipeline.drain()  # every update the trained batches owe is in the tables
            log.info(f"checkpoint {checkpointer.save(trainer.step, state)}", extra={"step": trainer.step})
        aside += time.perf_counter() - paused

    replica.check_group("the end of the run")
    pipeline.drain()
    # Summary and the bubble report.
    summary = {
        "run_dir": run_dir,
        "steps": trainer.step,
        "first_step": first_step + 1,
        "steps_this_launch": trainer.step - first_step,
        "resumed_from": resume_from or None,
        "ranks": topo.world_size,
        "wall_s": round(time.perf_counter() - started, 3),
        "train_s": round(time.perf_counter() - started - aside, 3),  # without evaluations and checkpoints
        "efficiency": {**mfu.measures(tally.flops, tally.samples, tally.seconds, peak.flop_per_s, topo.world_size),
                       "peak(TFLOP/s per rank)": round(peak.flop_per_s / 1e12, 6)},
    }
    if trainer.step == first_step:
        log.info(f"nothing to train: already at step {trainer.step} of {cfg.train.steps}")
        summary.update(_evaluate(pipeline, held_out, log, trainer.step, group, cfg, inputs.train_source))
    else:
        summary.update(_last_eval(run_dir) if topo.is_main else {})
    timeline.finish()
    dist.barrier(group=group)
    if topo.is_main and cfg.profile.enable and trainer.step > first_step:
        summary["bubbles"] = _write_bubble_report(run_dir, cfg, log)
    if topo.is_main:
        write_json_atomic(os.path.join(run_dir, "summary.json"), summary)
    dist.barrier(group=group)
    return summary


def group_has_run_before(run_dir: str, group: dist.ProcessGroup) -> bool:
    """Whether the replica group committed steps in this folder, or the job has checkpoints.

    Decided once for the group, by its rank 0 (``distributed.agreed``): another group may write
    its first checkpoint between two of this group's ranks' looks, and ranks that decided apart
    would each wait for the other in a different collective."""
    return distributed.agreed(lambda: ReplicaFiles(run_dir).read_cursor() is not None or bool(job_checkpoints(run_dir)),
                              group)


def job_checkpoints_agreed(run_dir: str, group: dist.ProcessGroup) -> list[tuple[int, str]]:
    """The job's checkpoints as the group's rank 0 sees them, on every rank (the same reason)."""
    return distributed.agreed(lambda: job_checkpoints(run_dir), group)


def newest_job_step(run_dir: str, group: dist.ProcessGroup) -> int:
    """The step of the job's newest checkpoint (0: none), the same on every rank of the group."""
    found = job_checkpoints_agreed(run_dir, group)
    return found[-1][0] if found else 0


def _restore_newest(checkpointer: Checkpointer, state: TrainingState, run_dir: str, log: logging.Logger,
                    group: dist.ProcessGroup) -> None:
    """Load the job's newest checkpoint (this group's first among equal steps), the same on every
    rank of the group."""
    found = job_checkpoints_agreed(run_dir, group)
    if not found:
        log.warning("no checkpoint in this job: training starts again from step 0 (set checkpoint.every to "
                    "limit what a loss of every group costs)")
        return
    own = os.path.abspath(run_dir)
    newest = min((c for c in found if c[0] == found[-1][0]), key=lambda c: not c[1].startswith(own))
    checkpointer.load(newest[1], state)
    log.warning(f"resumed from the newest checkpoint of the job, step {newest[0]} ({newest[1]}); "
                f"what was trained after it is trained again")


class GarbageCollector:
    """Automatic collection off; a full collection every ``every`` steps instead.

    Objects alive after set-up are frozen first, so the scheduled collections only walk what
    training allocated since. ``close`` restores Python's own schedule.
    """

    def __init__(self, every: int) -> None:
        self.every = every
        self._closed = False
        if every:
            gc.collect()
            gc.freeze()
            gc.disable()

    def step(self, step: int) -> None:
        if self.every and step % self.every == 0:
            gc.collect()

    def close(self) -> None:
        if self.every and not self._closed:
            gc.unfreeze()
            gc.enable()
        self._closed = True


def _due(step: int, every: int, last: int) -> bool:
    """Whether a periodic action runs at ``step``: every N steps, and at step ``last``."""
    return (every > 0 and step % every == 0) or step == last


def _log_progress(step: int, window: StepWindow, metrics: MetricsLog, log: logging.Logger,
                  group: dist.ProcessGroup, peak_flop_per_s: float, tally: FlopsTally) -> StepWindow:
    """Mean loss over the replica's ranks and the window's steps, the replica's samples/s, model
    TFLOP/s and MFU (against the per-rank peak times the ranks); starts a new window."""
    totals = window.totals()
    dist.all_reduce(totals, group=group)
    elapsed = time.perf_counter() - window.started
    loss, samples, flops = (totals[0] / totals[1]).item(), totals[2].item(), totals[3].item()
    tally.add(flops, samples, elapsed)
    record = {
        "step": step,
        "train/loss": loss,
        "throughput/samples_per_s": round(samples / elapsed, 2),
        "time/step(ms)": round(1000 * elapsed / len(window.losses), 3),
        **mfu.measures(flops, samples, elapsed, peak_flop_per_s, dist.get_world_size(group)),
    }
    metrics.write(record)
    log.info(f"loss {loss:.4f} | {record['throughput/samples_per_s']:.0f} samples/s | "
             f"{record['time/step(ms)']:.1f} ms/step | {1000 * record['train/tflops(TFLOP/s)']:.2f} GFLOP/s | "
             f"MFU {record['train/mfu(%)']:.2f}%", extra={"step": step})
    return StepWindow()


def _evaluate(pipeline: TrainPipeline, held_out: list, log: logging.Logger, step: int, group: dist.ProcessGroup,
              cfg: ExperimentConfig, items: SampleSource) -> dict:
    """Ranking: AUC, normalized entropy, calibration, log loss and GAUC per label over every
    rank's held-out samples (TorchRec's metrics, reduced across the replica's ranks); retrieval:
    HR@K, NDCG@K and MRR of the held-out next items ranked against the whole item table
    (``items``: the source of its size and of the items' side features)."""
    if cfg.task.kind == "retrieval":
        with pipeline.evaluating() as model:
            result = evaluate_retrieval(model, held_out, num_items=items.num_items, ks=cfg.task.eval_ks,
                                        exclude_history=cfg.task.exclude_history, group=group,
                                        user_hash_size=cfg.model.user_hash_size, source=items)
        if result:
            log.info(retrieval_line(result, cfg.task.eval_ks), extra={"step": step})
        return result
    metrics = HeldOutMetrics(group, batch_size=max((len(b.labels) for b in held_out), default=1),
                             labels=label_names(cfg.data, cfg.task.kind))
    with pipeline.evaluating() as model:
        for batch in held_out:
            _, out = model(batch)
            metrics.update(out.logits, out.labels, batch.candidate_users())
    result = metrics.compute()
    if result:
        log.info(f"eval auc {result['eval/auc']:.4f} | gauc {result.get('eval/gauc', float('nan')):.4f} | ne "
                 f"{result['eval/ne']:.4f} | calibration {result['eval/calibration']:.3f} | loss "
                 f"{result['eval/loss']:.4f} over {result['eval/samples']} candidates", extra={"step": step})
    return result


def _prepare_run_dir(cfg: ExperimentConfig, topo: Topology, resume_from: str) -> str:
    """Create (main rank) and agree on the run folder; write the resolved config into it."""
    path = None
    if topo.is_main:
        if cfg.run.dir:
            path = cfg.run.dir
        elif resume_from:
            path = run_dir_of(resume_from)
        else:
            stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
            path = base = os.path.join(cfg.run.out_dir, f"{cfg.run.name}-{stamp}")
            suffix = 1
            while os.path.exists(path):
                suffix += 1
                path = f"{base}-{suffix}"
        os.makedirs(path, exist_ok=True)
        write_config(cfg, os.path.join(path, "config.yaml"))
    return distributed.broadcast_object(path, topo.pg)


def _write_bubble_report(run_dir: str, cfg: ExperimentConfig, log: logging.Logger) -> dict:
    path = write_report(run_dir, warmup_steps=cfg.profile.warmup_steps, gantt_steps=cfg.profile.gantt_steps)
    with open(path) as f:
        summary = json.load(f)["summary"]
    collision = (f" | collision rate {100 * summary['collision_rate']:.1f}%" if "collision_rate" in summary else "")
    efficiency = (f" | {summary['train_flop_per_sample'] / 1e6:.2f} MFLOP/sample, MFU {summary['mfu_pct']:.2f}%"
                  if "mfu_pct" in summary else "")
    log.info(f"bubbles: fraction {summary['bubble_fraction']:.3f} | straggler {summary['straggler_pct']:.1f}% | "
             f"exposed comm {summary['exposed_comm_ms_per_step']:.1f} ms/step | data wait "
             f"{summary['data_wait_ms_per_step']:.1f} ms/step{collision}{efficiency} -> {os.path.dirname(path)}/report.html")
    return summary


def _last_eval(run_dir: str) -> dict:
    records = [r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if any(k.startswith("eval/") for k in r)]
    return {k: v for k, v in records[-1].items() if k != "step"} if records else {}


def _quiet_third_party_logs() -> None:
    """TorchRec's planner and pipelines log at INFO/WARNING on every start; keep the console ours."""
    for name in ("torchrec", "torch.distributed", "torch.fx", "fbgemm_gpu", "torchft"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module="torchrec")
    warnings.filterwarnings("ignore", category=UserWarning, module="torchrec")
