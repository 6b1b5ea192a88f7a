"""The private TorchRec attributes FreeScale reads: a missing one is named with the versions,
another version only warns (once), and the installed TorchRec keeps them where the module looks
(one rank, in process: a real DMP model under a real sparse-dist pipeline)."""

import logging

import pytest
import torch
import torch.distributed as dist
from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

from freescale import compat
from freescale.balance.balancer import NullBalancer
from freescale.config import load_config
from freescale.data.loader import BatchLoader, build_sources
from freescale.distributed import Topology
from freescale.profile.timeline import NullTimeline
from freescale.train.training import build_training
from helpers.launch import FAST, QUICKSTART


@pytest.fixture(autouse=True)
def versions_checked_afresh():
    compat.check_versions.cache_clear()
    yield
    compat.check_versions.cache_clear()


class FakePipeline:
    """A pipeline of another TorchRec version: the rewritten modules are kept under another name."""

    def __init__(self) -> None:
        self._rewritten_modules = [torch.nn.Linear(1, 1)]


def test_a_missing_attribute_is_named_with_its_type_and_the_versions(monkeypatch):
    monkeypatch.setattr(compat, "installed_versions", lambda: {"torchrec": "1.9.0", "fbgemm-gpu": "1.8.0"})
    with pytest.raises(compat.PrivateAttributeMissing) as raised:
        compat.pipeline_forwards(FakePipeline())
    message = str(raised.value)
    assert "FakePipeline has no attribute _pipelined_modules" in message
    assert "TorchRec 1.9.0 (pinned 1.8.0), fbgemm-gpu 1.8.0 (pinned 1.8.0)" in message
    assert "evaluation" in message  # what it is read for


def test_forwards_saved_for_other_modules_than_found_are_refused():
    pipeline = FakePipeline()
    pipeline._pipelined_modules = pipeline._rewritten_modules
    pipeline._original_forwards, pipeline._original_kjt_dist_forwards = [], []
    with pytest.raises(compat.PrivateAttributeMissing, match="saved 0 module .* for 1 pipelined modules"):
        compat.pipeline_forwards(pipeline)


def test_another_version_warns_once_and_reads_on(monkeypatch, caplog):
    monkeypatch.setattr(compat, "installed_versions", lambda: {"torchrec": "1.9.0", "fbgemm-gpu": "1.8.0"})
    pipeline = FakePipeline()
    with caplog.at_level(logging.WARNING, logger="freescale"):
        assert compat.private(pipeline, "_rewritten_modules", "to test") is pipeline._rewritten_modules
        compat.private(pipeline, "_rewritten_modules", "to test")
    warnings = [r.getMessage() for r in caplog.records if "pinned" in r.getMessage()]
    assert len(warnings) == 1 and "TorchRec 1.9.0 (pinned 1.8.0)" in warnings[0]


def test_a_renamed_method_to_override_is_refused():
    class Pipeline:
        def start_sparse_data_dist(self):
            pass

    compat.require_methods(Pipeline, "start_sparse_data_dist")
    with pytest.raises(compat.PrivateAttributeMissing, match="has no attribute wait_sparse_data_dist"):
        compat.require_methods(Pipeline, "start_sparse_data_dist", "wait_sparse_data_dist")


@pytest.fixture(scope="module")
def one_rank():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield


def test_the_installed_torchrec_keeps_the_attributes_where_compat_reads_them(one_rank):
    cfg = load_config(QUICKSTART, FAST)
    source, _ = build_sources(cfg.data, cfg.run.seed, task=cfg.task)
    topology = Topology(rank=0, world_size=1, local_rank=0, local_world_size=1)
    training = build_training(cfg, num_items=source.num_items, topology=topology, device=torch.device("cpu"))
    kernels = compat.sharded_kernels(training.model)
    assert kernels and all(isinstance(k, SplitTableBatchedEmbeddingBagsCodegen) for k in kernels)

    pipeline = training.build_pipeline(torch.device("cpu"), NullTimeline(), group=dist.group.WORLD, replica=None)
    assert compat.pipeline_forwards(pipeline.inner).modules == []  # nothing rewritten before the first batch
    loader = BatchLoader(source, batch_size=cfg.data.batch_size, rank=0, world_size=1,
                         user_hash_size=cfg.model.user_hash_size)
    batches = NullBalancer(cfg.model.user_hash_size).batches(loader.iter_samples())
    pipeline.progress(batches)
    saved = compat.pipeline_forwards(pipeline.inner)
    assert saved.modules and saved.kjt_dists  # the sharded collections and their id all-to-alls
    rewritten = [m.forward for m in saved.modules] + [d.forward for d in saved.kjt_dists]
    with pipeline.evaluating():
        assert [m.forward for m in saved.modules] + [d.forward for d in saved.kjt_dists] == \
            saved.originals + saved.kjt_dist_originals
    assert [m.forward for m in saved.modules] + [d.forward for d in saved.kjt_dists] == rewritten
    pipeline.progress(batches)  # the batch in flight trains on
    pipeline.close()
