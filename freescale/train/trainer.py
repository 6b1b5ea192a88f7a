"""The training loop.

``train(cfg)`` is the whole job on one rank: set-up in short sections, then a loop of a few
calls per step. It runs standalone (one rank) or under ``torchrun`` (one process per rank).
"""

from __future__ import annotations

import datetime
import gc
import json
import logging
import os
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from freescale import distributed
from freescale.balance.balancer import build_balancer
from freescale.config import ExperimentConfig, write_config
from freescale.data.loader import BatchLoader, build_sources, eval_batches
from freescale.distributed import Topology
from freescale.io import write_json_atomic
from freescale.logging import setup_logging
from freescale.model.seqrec import SeqRecModel
from freescale.model.sharding import build_optimizer, init_dense_state, shard_model
from freescale.profile.report import write_report
from freescale.profile.straggler import inject_delay
from freescale.profile.timeline import build_timeline, instrument_phases
from freescale.train.checkpoint import Checkpointer, resolve_checkpoint, run_dir_of
from freescale.train.metrics import MetricsLog, auc, log_loss, normalized_entropy, read_metrics
from freescale.train.pipelines import Pipeline, build_pipeline


@dataclass
class TrainState:
    """What the trainer itself must carry across a restart."""

    step: int = 0
    next_batch: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "next_batch": self.next_batch}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.next_batch = int(state["next_batch"])


@dataclass
class StepWindow:
    """Losses and timing since the last log line."""

    losses: list = field(default_factory=list)
    samples: int = 0
    started: float = field(default_factory=time.perf_counter)

    def add(self, loss: torch.Tensor, samples: int) -> None:
        self.losses.append(loss)
        self.samples += samples


def train(cfg: ExperimentConfig) -> dict:
    """Run (or resume) the experiment; returns the summary also written to summary.json."""
    # Processes, devices, logging.
    device = distributed.resolve_device(cfg.run.device, int(os.environ.get("LOCAL_RANK", 0)))
    topo = distributed.init_distributed(device, cfg.train.backend)
    threads = distributed.set_threads(cfg.run.threads, topo.local_world_size)
    log = setup_logging(topo.replica_id, topo.rank)
    _quiet_third_party_logs()
    log.info(f"{topo.world_size} rank(s) on {device.type}, {threads} thread(s) per rank")

    # Run folder: new, explicit, or the one being resumed.
    resume_from = resolve_checkpoint(cfg.checkpoint.resume) if cfg.checkpoint.resume else ""
    run_dir = _prepare_run_dir(cfg, topo, resume_from)
    log.info(f"run folder: {run_dir}")
    metrics = MetricsLog(os.path.join(run_dir, "metrics.jsonl"), enabled=topo.is_main)

    # Data: this rank's slice of every global batch, and its share of the held-out samples.
    train_source, eval_source = build_sources(cfg.data, cfg.run.seed)
    loader = BatchLoader(train_source, batch_size=cfg.data.batch_size, rank=topo.rank, world_size=topo.world_size,
                         user_hash_size=cfg.model.user_hash_size)
    held_out = eval_batches(eval_source, num_samples=cfg.data.eval_samples, batch_size=cfg.data.batch_size,
                            rank=topo.rank, world_size=topo.world_size, user_hash_size=cfg.model.user_hash_size)

    # Model: built on the meta device, embedding tables sharded and materialized by DMP.
    torch.manual_seed(cfg.run.seed)
    model = SeqRecModel(cfg.model, cfg.embedding, num_items=train_source.num_items,
                        max_uih_len=cfg.data.max_uih_len, device=torch.device("meta"))
    model = shard_model(model, cfg.embedding, topo, device)
    optimizer = build_optimizer(model, cfg.train)

    # Resume: model, optimizers, step, data cursor and RNG from the checkpoint.
    state = TrainState()
    checkpointer = Checkpointer(run_dir, cfg.checkpoint, rank=topo.rank)
    if resume_from:
        init_dense_state(optimizer)
        app = checkpointer.app_state(model, optimizer, state.state_dict())
        checkpointer.load(resume_from, app)
        model.load_state_dict(app["model"])
        optimizer.load_state_dict(app["optimizer"])
        state.load_state_dict({k: int(v) for k, v in app["trainer"].items()})
        log.info(f"resumed from {resume_from} at step {state.step}")
    loader.load_state_dict({"next_batch": state.next_batch})

    # Profiling: per-step timelines (a NullTimeline when off), phase spans, straggler injection.
    timeline = build_timeline(cfg.profile, run_dir, rank=topo.rank, world_size=topo.world_size, threads=threads,
                              device_type=device.type)
    inject_delay(model, timeline, rank=topo.rank, ranks=cfg.profile.delay_ranks, delay_ms=cfg.profile.delay_ms)
    instrument_phases(timeline, model, optimizer)

    # Balancer: every global batch re-partitioned by cost (a NullBalancer keeps contiguous slices).
    balancer = build_balancer(cfg.balance, cfg.transport, user_hash_size=cfg.model.user_hash_size)
    if topo.is_main and cfg.balance.enable:
        balancer.cost_model.save(os.path.join(run_dir, "cost_model.json"))

    # The loop. Python's collector runs on a schedule shared by all ranks: left to itself it
    # pauses one rank at a time, and every pause becomes a straggler bubble on the others.
    collector = GarbageCollector(cfg.train.gc_every)
    pipeline = build_pipeline(cfg.train.pipeline, model, optimizer, device, timeline)
    batches = timeline.timed_batches(balancer.batches(loader.iter_samples()))
    window = StepWindow()
    started = time.perf_counter()
    first_step = state.step
    while state.step < cfg.train.steps:
        timeline.begin_step(state.step + 1)
        out = pipeline.progress(batches)
        state.step += 1
        timeline.end_step(state.step, out)
        collector.step(state.step)
        state.next_batch = BatchLoader.cursor_after(out.batch_index.item())["next_batch"]
        window.add(out.loss, len(out.sample_ids))
        if _due(state.step, cfg.run.log_every, cfg.train.steps):
            window = _log_progress(state.step, window, metrics, log)
        if held_out and _due(state.step, cfg.train.eval_every, cfg.train.steps):
            metrics.write({"step": state.step, **_evaluate(pipeline, held_out, log, state.step)})
        if _due(state.step, cfg.checkpoint.every, cfg.train.steps if cfg.checkpoint.at_end else 0):
            path = checkpointer.save(state.step, checkpointer.app_state(model, optimizer, state.state_dict()))
            log.info(f"checkpoint {path}", extra={"step": state.step})

    collector.close()
    summary = {
        "run_dir": run_dir,
        "steps": state.step,
        "steps_this_launch": state.step - first_step,
        "ranks": topo.world_size,
        "wall_s": round(time.perf_counter() - started, 3),
    }
    if state.step == first_step:
        log.info(f"nothing to train: already at step {state.step} of {cfg.train.steps}")
        summary.update(_evaluate(pipeline, held_out, log, state.step))
    else:
        summary.update(_last_eval(run_dir) if topo.is_main else {})
    timeline.finish()
    dist.barrier()
    if topo.is_main and cfg.profile.enable and state.step > first_step:
        summary["bubbles"] = _write_bubble_report(run_dir, cfg, log)
    if topo.is_main:
        write_json_atomic(os.path.join(run_dir, "summary.json"), summary)
    dist.barrier()
    return summary


class GarbageCollector:
    """Automatic collection off; a full collection every ``every`` steps instead.

    Objects alive after set-up are frozen first, so the scheduled collections only walk what
    training allocated since.
    """

    def __init__(self, every: int) -> None:
        self.every = every
        if every:
            gc.collect()
            gc.freeze()
            gc.disable()

    def step(self, step: int) -> None:
        if self.every and step % self.every == 0:
            gc.collect()

    def close(self) -> None:
        if self.every:
            gc.unfreeze()
            gc.enable()


def _due(step: int, every: int, last: int) -> bool:
    """Whether a periodic action runs at ``step``: every N steps, and at step ``last``."""
    return (every > 0 and step % every == 0) or step == last


def _log_progress(step: int, window: StepWindow, metrics: MetricsLog, log: logging.Logger) -> StepWindow:
    """Mean loss over ranks and steps of the window, global samples/s; starts a new window."""
    totals = torch.stack([torch.stack(window.losses).sum(), torch.tensor(float(len(window.losses))),
                          torch.tensor(float(window.samples))]).double()
    dist.all_reduce(totals)
    elapsed = time.perf_counter() - window.started
    loss = (totals[0] / totals[1]).item()
    record = {
        "step": step,
        "train/loss": loss,
        "throughput/samples_per_s": round(totals[2].item() / elapsed, 2),
        "time/step(ms)": round(1000 * elapsed / len(window.losses), 3),
    }
    metrics.write(record)
    log.info(f"loss {loss:.4f} | {record['throughput/samples_per_s']:.0f} samples/s | "
             f"{record['time/step(ms)']:.1f} ms/step", extra={"step": step})
    return StepWindow()


def _evaluate(pipeline: Pipeline, held_out: list, log: logging.Logger, step: int) -> dict:
    """AUC, normalized entropy and log loss over every rank's held-out samples."""
    logits, labels = [], []
    with pipeline.evaluating() as model:
        for batch in held_out:
            _, out = model(batch)
            logits.append(out.logits.float().cpu())
            labels.append(out.labels.float().cpu())
    local = (torch.cat(logits).numpy(), torch.cat(labels).numpy()) if logits else (np.zeros(0), np.zeros(0))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    all_logits = np.concatenate([g[0] for g in gathered])
    all_labels = np.concatenate([g[1] for g in gathered])
    if len(all_labels) == 0:
        return {}
    result = {
        "eval/auc": round(auc(all_labels, all_logits), 6),
        "eval/ne": round(normalized_entropy(all_labels, all_logits), 6),
        "eval/loss": round(log_loss(all_labels, all_logits), 6),
        "eval/samples": int(len(all_labels)),
    }
    log.info(f"eval auc {result['eval/auc']:.4f} | ne {result['eval/ne']:.4f} | loss {result['eval/loss']:.4f} "
             f"over {result['eval/samples']} candidates", extra={"step": step})
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
    return distributed.broadcast_object(path)


def _write_bubble_report(run_dir: str, cfg: ExperimentConfig, log: logging.Logger) -> dict:
    path = write_report(run_dir, warmup_steps=cfg.profile.warmup_steps, gantt_steps=cfg.profile.gantt_steps)
    with open(path) as f:
        summary = json.load(f)["summary"]
    log.info(f"bubbles: fraction {summary['bubble_fraction']:.3f} | straggler {summary['straggler_pct']:.1f}% | "
             f"exposed comm {summary['exposed_comm_ms_per_step']:.1f} ms/step | data wait "
             f"{summary['data_wait_ms_per_step']:.1f} ms/step -> {os.path.dirname(path)}/report.html")
    return summary


def _last_eval(run_dir: str) -> dict:
    records = [r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "eval/auc" in r]
    return {k: v for k, v in records[-1].items() if k != "step"} if records else {}


def _quiet_third_party_logs() -> None:
    """TorchRec's planner and pipelines log at INFO/WARNING on every start; keep the console ours."""
    for name in ("torchrec", "torch.distributed", "torch.fx", "fbgemm_gpu"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module="torchrec")
    warnings.filterwarnings("ignore", category=UserWarning, module="torchrec")
