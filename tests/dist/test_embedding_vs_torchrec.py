"""FreeScale's tables, synchronous mode, against TorchRec's DistributedModelParallel training of
the same model on the same data (2 gloo ranks).

Both shard the item table row-wise in the same blocks and fuse fbgemm's row-wise Adagrad into
the backward (TorchRec's ``RowWiseAdagrad``, ``EXACT_ROWWISE_ADAGRAD``, eps 1e-8, lr 0.05); the
dense part trains with SGD (lr 0.05; Adam would hide a gradient scaled wrongly), gradients
averaged over the ranks (TorchRec's DDP, or one flat all-reduce). Starting from the same weights, the first steps are bitwise alike; over
16 steps losses agree to rtol 1e-5 and every table row to 1e-4 absolute.
"""

import pytest
import torch

from freescale.config import load_config
from freescale.distributed import Topology
from freescale.embedding.pipeline import build_owned_model
from freescale.model.seqrec import ITEM_TABLE, SeqRecModel
from freescale.model.sharding import build_dense_optimizer, build_optimizer, shard_model
from freescale.profile.timeline import NullTimeline
from freescale.train.pipelines import build_pipeline
from helpers.launch import QUICKSTART
from helpers.owned_tables import ITEMS, SMALL, batches_of
from helpers.spawn import run_ranks

pytestmark = pytest.mark.slow

RTOL = 1e-5  # per-step losses
ROW_ATOL = 1e-4  # every table row after STEPS steps (row-wise Adagrad normalizes: rounding shows up to ~3e-5)
STEPS = 16


def _agree(rank, world):
    cfg = load_config(QUICKSTART, [*SMALL, "--model.user_features=false", "--embedding.lr=0.05", "--train.optimizer=sgd",
                                     "--train.lr=0.05"])
    topo = Topology(rank=rank, world_size=world, local_rank=rank, local_world_size=world)
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    ours = build_owned_model(cfg, num_items=ITEMS, max_uih_len=cfg.data.max_uih_len, topology=topo, seed=7)
    ours_opt = build_dense_optimizer(ours.task, cfg.train)
    torch.manual_seed(0)
    theirs = shard_model(SeqRecModel(cfg.model, cfg.embedding, num_items=ITEMS, max_uih_len=cfg.data.max_uih_len,
                                     device=torch.device("meta")), cfg.embedding, topo, cpu)
    theirs_opt = build_optimizer(theirs, cfg.train)

    # The same starting point: our rows into TorchRec's row-wise shard, TorchRec's dense weights into ours.
    state = theirs.state_dict()
    shard = state[f"item_ec.embeddings.{ITEM_TABLE}.weight"].local_shards()[0].tensor
    assert shard.shape == ours.tables.weight.shape  # the same row-wise blocks
    with torch.no_grad():
        shard.copy_(ours.tables.weight)
    ours.task.load_state_dict({k[len("task."):]: v for k, v in state.items() if k.startswith("task.")})

    pipelines = {
        "ours": build_pipeline("sync", ours, ours_opt, cpu, NullTimeline(), group=topo.pg, transport_cfg=cfg.transport),
        "torchrec": build_pipeline("base", theirs, theirs_opt, cpu, NullTimeline()),
    }
    streams = {name: iter(batches_of(rank)[:STEPS]) for name in pipelines}
    losses = {name: [] for name in pipelines}
    for _ in range(STEPS):
        for name, pipeline in pipelines.items():
            losses[name].append(pipeline.progress(streams[name]).loss.item())
    pipelines["ours"].close()

    # The first steps are bitwise alike; then the two sum a few gradients in another order.
    assert losses["ours"][:2] == losses["torchrec"][:2]
    torch.testing.assert_close(losses["ours"], losses["torchrec"], rtol=RTOL, atol=1e-6)
    rows = theirs.state_dict()[f"item_ec.embeddings.{ITEM_TABLE}.weight"].local_shards()[0].tensor
    torch.testing.assert_close(ours.tables.weight, rows, rtol=0, atol=ROW_ATOL)
    # Training moved the rows a hundred times further than the two disagree.
    fresh = build_owned_model(cfg, num_items=ITEMS, max_uih_len=cfg.data.max_uih_len, topology=topo, seed=7)
    assert (fresh.tables.weight - rows).abs().max() > 100 * ROW_ATOL


def test_synchronous_mode_agrees_with_torchrec_dmp():
    run_ranks(2, _agree)
