"""The per-row state of fbgemm's fused kernels as the replica layer sees it: row blocks that
are views of the kernel, the rows of each table a lookup reads, and the rows TorchRec's
sharded tables report before backward writes them (one rank, in process)."""

import pytest
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (ComputeDevice,
                                                                    SplitTableBatchedEmbeddingBagsCodegen)

from freescale.balance.balancer import NullBalancer
from freescale.config import load_config
from freescale.data.loader import BatchLoader, build_sources
from freescale.distributed import Topology
from freescale.ft.rows import FusedTables, kernel_blocks, rows_per_table
from freescale.model.seqrec import SeqRecModel
from freescale.model.sharding import shard_model
from helpers.launch import FAST, QUICKSTART


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield


def kernel(feature_table_map=(0, 1, 0)):
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(10, 4, EmbeddingLocation.HOST, ComputeDevice.CPU), (6, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        feature_table_map=list(feature_table_map), optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        pooling_mode=PoolingMode.NONE, learning_rate=0.1)


def test_row_blocks_are_views_of_the_kernel():
    k = kernel()
    blocks = kernel_blocks(k)
    assert [[tuple(t.shape) for t in b] for b in blocks] == [[(10, 4), (10,)], [(6, 4), (6,)]]
    with torch.no_grad():
        blocks[1][0][5] = 7.0
        blocks[0][1][2] = 3.0
    assert torch.equal(k.split_embedding_weights()[1][5], torch.full((4,), 7.0))
    assert float(k.split_optimizer_states()[0][0][2]) == 3.0


def test_rows_are_split_by_table_through_the_feature_map():
    # Features 0 and 2 read table 0, feature 1 table 1; two bags per feature.
    indices = torch.tensor([1, 2, 3, 0, 5, 5, 9])
    offsets = torch.tensor([0, 2, 3, 4, 6, 7, 7])
    rows = rows_per_table(kernel(), indices, offsets)
    assert [r.tolist() for r in rows] == [[1, 2, 3, 9], [0, 5, 5]]
    # A batch of its own per feature (TorchRec's variable batch): 1 bag, 3 bags, 1 bag.
    offsets = torch.tensor([0, 2, 3, 4, 6, 7])
    rows = rows_per_table(kernel(), indices[:7], offsets, batch_size_per_feature_per_rank=[[1], [3], [1]])
    assert [r.tolist() for r in rows] == [[1, 2, 9], [3, 0, 5, 5]]
    single = SplitTableBatchedEmbeddingBagsCodegen([(10, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)],
                                                   pooling_mode=PoolingMode.NONE)
    assert [r.tolist() for r in rows_per_table(single, indices, torch.tensor([0, 7]))] == [indices.tolist()]


def test_torchrec_tables_report_the_rows_each_lookup_reads():
    cfg = load_config(QUICKSTART, FAST)
    source, _ = build_sources(cfg.data, cfg.run.seed, task=cfg.task)
    model = SeqRecModel(cfg.model, cfg.embedding, num_items=source.num_items, max_uih_len=cfg.data.max_uih_len,
                        device=torch.device("meta"))
    model = shard_model(model, cfg.embedding, Topology(rank=0, world_size=1, local_rank=0, local_world_size=1),
                        torch.device("cpu"))
    tables = FusedTables(model)
    assert [tuple(b[0].shape) for b in tables.blocks()] == [(source.num_items, cfg.model.embedding_dim),
                                                          (cfg.model.user_hash_size, cfg.model.embedding_dim)]
    loader = BatchLoader(source, batch_size=cfg.data.batch_size, rank=0, world_size=1,
                         user_hash_size=cfg.model.user_hash_size)
    batch = next(NullBalancer(cfg.model.user_hash_size).batches(loader.iter_samples()))
    reported = []
    with tables.reporting(reported.extend):
        model(batch)
    model(batch)  # outside: nothing reported
    assert len(reported) == 2
    (items_block, items), (users_block, users) = reported
    assert (items_block, users_block) == (0, 1)
    assert sorted(items.tolist()) == sorted(batch.seq_features.values().tolist())
    assert sorted(users.tolist()) == sorted(batch.user_features.values().tolist())
    tables.close()
