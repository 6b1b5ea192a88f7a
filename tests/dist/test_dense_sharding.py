"""``dense.sharding: fsdp`` against ``replicate`` on 2 gloo ranks: the same training, the dense
part and its optimizer state sharded per block, ``prioritized`` still bit for bit ``sync``, a
run's checkpoints those of ``replicate``, a resume bit for bit, an export of the whole model."""

import copy
import shutil
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from freescale.model.dense_sharding import DenseReduction, FullyShard, ShardedReduction
from freescale.profile.timeline import NullTimeline
from freescale.train.verify import snapshot
from helpers.launch import FAST, QUICKSTART, check, freescale, ranks
from helpers.owned_tables import batches_of, build, train_through
from helpers.spawn import run_ranks

pytestmark = pytest.mark.slow

STEPS = 50
TOLERANCE = 0.0
"""Largest difference allowed between ``fsdp`` and ``replicate`` (losses, dense parameters,
embedding rows, after 50 steps). The two sum the ranks' gradients in a different order (a
reduce-scatter per block against one flat all-reduce), which in general differs by float
rounding. On 2 ranks it does not: each element is the sum of two values (a + b == b + a
exactly) halved (exact in binary floats), so the two agree bit for bit, and anything that
changes the arithmetic (a gradient not averaged, a rank's part lost, a parameter the optimizer
does not step) shows at once. With more ranks per group expect about one float32 rounding per
gradient (1e-7 relative)."""


def _stream(rank):
    """50 batches: the 26 of ``batches_of`` and their first 24 again."""
    return (batches_of(rank) * 2)[:STEPS]


def _train(mode, sharding, rank, world):
    model, optimizer, pipeline = build(mode, rank, world, "torch_dist", NullTimeline(),
                                       overrides=[f"--train.pipeline={mode}", f"--dense.sharding={sharding}"])
    losses = train_through(pipeline, iter(_stream(rank)))
    pipeline.drain()
    state = snapshot(model, optimizer)
    pipeline.close()
    return losses, state, model


def _whole(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


def _local_numel(params):
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)


def _same_training(ref_losses, ref, losses, got, kinds=("embedding rows", "dense parameters", "dense optimizer state")):
    assert len(losses) == len(ref_losses) == STEPS
    worst = max(abs(a - b) for a, b in zip(losses, ref_losses))
    assert worst <= TOLERANCE, worst
    for kind in kinds:
        assert ref[kind].keys() == got[kind].keys() and ref[kind], kind
        for key in ref[kind]:
            diff = float((_whole(got[kind][key]).double() - _whole(ref[kind][key]).double()).abs().max())
            assert diff <= TOLERANCE, (kind, key, diff)


def _fsdp_against_replicate(rank, world):
    ref_losses, ref, ref_model = _train("sync", "replicate", rank, world)
    losses, got, model = _train("sync", "fsdp", rank, world)
    # Sharded per block, then the task: each layer is a unit of its own (its parameters gathered
    # for its forward alone), every parameter a DTensor of which this rank holds about half, and
    # the optimizer's state likewise.
    assert isinstance(model.task, FSDPModule)
    assert len(model.task.layers) and all(isinstance(layer, FSDPModule) for layer in model.task.layers)
    params = list(model.task.parameters())
    assert all(isinstance(p, DTensor) for p in params)
    whole = _local_numel(list(ref_model.task.parameters()))
    assert _local_numel(params) <= whole // world + len(params)  # (a parameter's shard rounds up)
    moments = [v for k, v in got["dense optimizer state"].items() if not k.endswith(".step")]
    assert moments and all(isinstance(v, DTensor) for v in moments)
    assert sum(v.to_local().numel() for v in moments) <= 2 * (whole // world + len(params))
    _same_training(ref_losses, ref, losses, got)
    # And it trained: the dense parameters moved.
    fresh = build("sync", rank, world, "torch_dist", NullTimeline())[0]
    moved = max(float((ref["dense parameters"][k] - p.detach()).abs().max()) for k, p in fresh.task.named_parameters())
    assert moved > 1e-3, moved
    # The prioritized pipeline with fsdp: bit for bit the synchronous one with fsdp (so, above,
    # the synchronous one with replicate).
    prioritized_losses, prioritized, _ = _train("prioritized", "fsdp", rank, world)
    _same_training(losses, got, prioritized_losses, prioritized)


def test_fsdp_trains_as_replicate_with_its_state_sharded_and_prioritized_as_sync():
    run_ranks(2, _fsdp_against_replicate)


class _HalfUsed(nn.Module):
    """Two blocks, the second never used: its parameters get no gradient in backward."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 6), nn.Linear(6, 6)])
        self.out = nn.Linear(6, 1)

    def forward(self, x):
        return self.out(self.layers[0](x)).sum()


def _unused_parameters(rank, world):
    torch.manual_seed(0)
    replicated = _HalfUsed()
    sharded = FullyShard().shard(copy.deepcopy(replicated), dist.group.WORLD)
    x = torch.randn(3, 4) + rank
    replicated(x).backward()
    DenseReduction(list(replicated.parameters()), dist.group.WORLD).wait()
    sharded(x).backward()
    ShardedReduction(list(sharded.parameters()), dist.group.WORLD).wait()
    for (name, ref), (_, got) in zip(replicated.named_parameters(), sharded.named_parameters()):
        assert got.grad is not None and torch.equal(got.grad.full_tensor(), ref.grad), name
    assert not replicated.layers[1].weight.grad.any()  # (the unused block's gradient: zeros under replicate)


def test_a_parameter_no_block_used_gets_a_zero_gradient_as_under_replicate():
    # So the optimizer steps the same parameters under both (Adam moves a parameter with a zero
    # gradient once it has momentum).
    run_ranks(2, _unused_parameters)


def _checkpoint(path):
    """Every tensor of a checkpoint, whole (DCP reads a sharded one as full tensors)."""
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    whole = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
             if isinstance(m, TensorStorageMetadata) and not k.startswith("rng.")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(whole, checkpoint_id=str(path), no_dist=True)
    return whole


def _assert_equal(a, b):
    assert a.keys() == b.keys() and any(k.startswith("model.task.") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_an_fsdp_run_checkpoints_resumes_and_exports_as_a_replicated_one(tmp_path):
    chosen = ["--train.pipeline=prioritized", "--train.steps=6", "--checkpoint.every=2", "--checkpoint.keep=3"]

    def train(name, *extra):
        run_dir = tmp_path / name
        check(ranks(2, "train", "--config", str(QUICKSTART), *FAST, *chosen, f"--run.dir={run_dir}", *extra))
        return run_dir

    replicated = train("replicate")
    sharded = train("fsdp", "--dense.sharding=fsdp")
    last = sharded / "checkpoints" / "step_00000006"
    # The checkpoint holds the whole model and optimizer state, as a replicated run's does.
    _assert_equal(_checkpoint(replicated / "checkpoints" / "step_00000006"), _checkpoint(last))
    # Resumed from step 2, the run ends where it did, bit for bit.
    first = tmp_path / "first_step_6"
    shutil.copytree(last, first)
    check(ranks(2, "train", "--config", str(QUICKSTART), *FAST, *chosen, "--dense.sharding=fsdp",
                   f"--checkpoint.resume={sharded / 'checkpoints' / 'step_00000002'}"))
    _assert_equal(_checkpoint(first), _checkpoint(last))
    # The export gathers the whole dense part: the replicated run's.
    for run_dir in (replicated, sharded):
        check(freescale("export", str(run_dir), "--out", str(tmp_path / f"export_{run_dir.name}")))
    exported = [torch.export.load(str(tmp_path / f"export_{name}" / "dense.pt2")).state_dict
                for name in ("replicate", "fsdp")]
    assert exported[0].keys() == exported[1].keys() and exported[0]
    for key in exported[0]:
        assert torch.equal(exported[0][key], exported[1][key]), key
