"""Side features in the model, in one process: the features resolved against a source's layout,
the pooling of FreeScale's own tables, the join against its formula, FLOPs against the counter,
and what the batch's KJTs give TorchRec's collections."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from freescale.config import ConfigError, ModelConfig, SideFeatureConfig, load_config
from freescale.data.batch import Batch, Samples, SideLayout
from freescale.data.sample_files import SideFeature
from freescale.model.seqrec import SeqRecModel, SeqRecTask, build_task
from freescale.model.side import SideFeaturesTask, SideJoin, pool_bags, side_specs

LAYOUT = SideLayout(user=(SideFeature("age", 10, 1), SideFeature("tags", 50, 3)),
                    item=(SideFeature("genre", 20, 2), SideFeature("brand", 7, 1)))


def model_cfg(*features, **kw) -> ModelConfig:
    base = dict(embedding_dim=8, num_layers=1, num_heads=2, mlp_dims=[8], user_features=True)
    return ModelConfig(**{**base, **kw}, side_features=[SideFeatureConfig(**f) for f in features])


def test_specs_take_the_source_s_sizes_and_join_users_then_sequence_then_pooled_features():
    cfg = model_cfg(dict(name="item:brand"), dict(name="item:genre", kind="sequence", dim=4, pooling="mean"),
                    dict(name="user:tags", rows=64))
    specs = side_specs(cfg, LAYOUT)
    assert [(s.key, s.rows, s.dim, s.pooling, s.sequence, s.max_values) for s in specs] == [
        ("user:tags", 64, 8, "sum", False, 3), ("item:genre", 20, 4, "mean", True, 2), ("item:brand", 7, 8, "sum", False, 1)]
    assert [s.table for s in specs] == ["user_tags_table", "item_genre_table", "item_brand_table"]


def test_a_feature_the_source_lacks_or_a_table_too_small_is_one_line_naming_the_key():
    with pytest.raises(ConfigError, match=r"^model.side_features\[1\].name: the source has no side feature user:height "
                                          r"\(it has: user:age, user:tags, item:genre, item:brand\)$"):
        side_specs(model_cfg(dict(name="user:age"), dict(name="user:height")), LAYOUT)
    with pytest.raises(ConfigError, match=r"has: none\)"):
        side_specs(model_cfg(dict(name="user:age")), SideLayout())
    with pytest.raises(ConfigError, match=r"^model.side_features\[0\].rows: item:genre takes 20 values, a table of 19 "
                                          r"rows has none for the rest: expected 0 or at least 20$"):
        side_specs(model_cfg(dict(name="item:genre", rows=19)), LAYOUT)


@pytest.mark.parametrize("overrides,message", [
    (["model.side_features=[{name: genre}]"], r"model.side_features\[0\].name: expected user:<name> or item:<name> \(no dot\)"),
    (["model.side_features=[{name: item:a.b}]"], r"model.side_features\[0\].name: expected user:<name> or item:<name>"),
    (["model.side_features=[{name: user:a}, {name: user:a}]"], r"model.side_features\[1\].name: user:a is listed twice"),
    (["model.side_features=[{name: user:a, kind: sequence}]"],
     r"model.side_features\[0\].kind: sequence joins an item feature into the history events; user:a is a user feature"),
    (["model.side_features=[{name: item:a, pooling: max}]"], r"model.side_features\[0\].pooling: expected one of sum, mean"),
    (["model.side_features=[{name: item:a, dim: -1}]"], r"model.side_features\[0\].dim: expected a value >= 0"),
    (["model.side_features=[{name: item:a, dim: 8}]", "train.pipeline=prioritized"],
     r"model.side_features\[0\].dim: FreeScale's own tables \(train.pipeline prioritized\) hold rows of "
     r"model.embedding_dim: expected 0 or 32, got 8"),
    (["model.side_features=[{name: item:a}]", "model.kind=hstu", "task.kind=retrieval"],
     r"model.side_features\[0\].kind: retrieval scores history items and candidates as one item tower"),
    (["model.side_features=[{name: user:a}]", "model.kind=hstu", "task.kind=retrieval"],
     r"model.side_features\[0\].name: retrieval reads no user representation"),
    (["model.side_features=[{nam: user:a}]"], r"unknown config key 'model.side_features\[0\].nam' \(did you mean"),
])
def test_side_feature_settings_fail_at_load_time_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_pooling_sums_or_averages_each_bag_and_leaves_an_empty_one_zero():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([2, 0, 3, 1])
    rows = torch.randn(6, 5, generator=g)
    for pooling in ("sum", "mean"):
        got = pool_bags(rows, lengths, max_values=3, pooling=pooling)
        bags = torch.split(rows, lengths.tolist())
        want = torch.stack([b.sum(0) / (max(len(b), 1) if pooling == "mean" else 1) for b in bags])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        assert torch.equal(got[1], torch.zeros(5))
    # A bag's pooled row is the same bits whichever bags share its batch.
    alone = pool_bags(rows[2:5], torch.tensor([3]), max_values=3, pooling="sum")
    assert torch.equal(alone[0], pool_bags(rows, lengths, max_values=3, pooling="sum")[2])


def test_the_join_adds_the_projected_concatenation_of_each_representation_s_features():
    specs = side_specs(model_cfg(dict(name="user:age", dim=3), dict(name="user:tags", dim=2),
                                 dict(name="item:genre", kind="sequence", dim=4), dict(name="item:brand", dim=5)), LAYOUT)
    join = SideJoin(specs, dim=8)
    g = torch.Generator().manual_seed(1)
    n, events, cands = 3, 7, 4
    uih, cand, user = (torch.randn(k, 8, generator=g) for k in (events, cands, n))
    user_side = {"user:age": torch.randn(n, 3, generator=g), "user:tags": torch.randn(n, 2, generator=g)}
    item_side = {"item:genre": torch.randn(events + cands, 4, generator=g),
                 "item:brand": torch.randn(events + cands, 5, generator=g)}  # (its history part is not read)
    got_uih, got_cand, got_user = join(uih, cand, user, user_side, item_side)
    torch.testing.assert_close(got_user, user + join.user(torch.cat([user_side["user:age"], user_side["user:tags"]], 1)))
    genre = join.sequence(item_side["item:genre"])
    torch.testing.assert_close(got_uih, uih + genre[:events])
    torch.testing.assert_close(got_cand, cand + genre[events:] + join.pooled(item_side["item:brand"][events:]))
    # A pooled feature's rows may be the candidates' alone (FreeScale's own tables send only those).
    alone = join(uih, cand, user, user_side, {**item_side, "item:brand": item_side["item:brand"][events:]})
    assert torch.equal(alone[1], got_cand)
    # Without a user-id row, the projection is the user row.
    torch.testing.assert_close(join(uih, cand, None, user_side, item_side)[2], got_user - user)
    # FLOPs: the projections' matmuls, as the counter sees them.
    with FlopCounterMode(display=False) as counter:
        join(uih, cand, user, user_side, item_side)
    assert join.flops([3, 0, 4], [1, 2, 1]) == counter.get_total_flops()


@pytest.mark.parametrize("kind", ["transformer", "hstu"])
def test_user_features_alone_give_the_task_a_user_row(kind):
    """model.user_features false with a user side feature: the head reads the projected user row."""
    cfg = model_cfg(dict(name="user:tags"), user_features=False, kind=kind)
    task = build_task(cfg, max_uih_len=16, max_candidates=2, side_specs=side_specs(cfg, LAYOUT))
    assert isinstance(task, SideFeaturesTask)
    L, C = torch.tensor([3, 1]), torch.tensor([2, 1])
    rows = lambda k: torch.randn(k, 8)  # noqa: E731
    loss, _ = task(rows(4), rows(3), None, {"user:tags": rows(2)}, {}, torch.zeros(7, dtype=torch.long), L, C,
                   torch.zeros(4, dtype=torch.long), torch.zeros(3, dtype=torch.long), torch.rand(3, 1),
                   torch.arange(2), torch.tensor(0), torch.tensor(1.0))
    loss.backward()
    assert task.join.user.weight.grad.abs().sum() > 0
    assert task.flops(L, C) == task.task.flops(L, C) + task.join.flops(L, C)
    if kind == "transformer":
        assert isinstance(task.task, SeqRecTask) and task.task.head[0].in_features == 4 * 8


def test_torchrec_s_collections_pool_what_the_batch_s_kjts_hold():
    """The unsharded model's side rows are each bag's pooled table rows (sum or mean)."""
    cfg = model_cfg(dict(name="user:tags", pooling="mean", dim=4), dict(name="item:genre", kind="sequence"),
                    dict(name="item:brand", dim=6))
    specs = side_specs(cfg, LAYOUT)
    model = SeqRecModel(cfg, load_config(None).embedding, num_items=50, max_uih_len=16, device=torch.device("cpu"),
                        side_specs=specs)
    samples = Samples(sample_ids=np.arange(2), user_ids=np.arange(2), uih_lengths=np.array([2, 1]),
                      uih_values=np.array([1, 2, 3]), uih_timestamps=np.zeros(3, np.int64), cand_counts=np.array([1, 2]),
                      cand_values=np.array([4, 5, 6]), cand_timestamps=np.zeros(3, np.int64),
                      labels=np.zeros((3, 1), np.float32), side_layout=LAYOUT,
                      user_side=np.array([[1, 4, 5, -1], [2, -1, -1, -1]]),
                      uih_side=np.array([[3, 4, 0], [5, -1, 1], [-1, -1, 2]]),
                      cand_side=np.array([[6, 7, 3], [8, -1, 4], [9, 10, 6]]))
    batch = Batch.from_samples(samples, 0, user_hash_size=100)
    tags = model.user_side_ebc.embedding_bags["user_tags_table"].weight
    genre = model.item_side_ebc.embedding_bags["item_genre_table"].weight
    brand = model.item_side_ebc.embedding_bags["item_brand_table"].weight
    user_side = model.user_side_ebc(batch.user_side_features).to_dict()
    item_side = model.item_side_ebc(batch.item_side_features).to_dict()
    torch.testing.assert_close(user_side["user:tags"], torch.stack([tags[[4, 5]].mean(0), torch.zeros(4)]))
    torch.testing.assert_close(item_side["item:genre"], torch.stack(
        [genre[[3, 4]].sum(0), genre[5], torch.zeros(8), genre[[6, 7]].sum(0), genre[8], genre[[9, 10]].sum(0)]))
    torch.testing.assert_close(item_side["item:brand"], brand[[0, 1, 2, 3, 4, 6]])
    loss, _ = model(batch)
    loss.backward()
    # Through the join, the loss reaches the rows the batch holds, and only those.
    assert torch.equal(tags.grad.abs().sum(1) > 0, torch.isin(torch.arange(50), torch.tensor([4, 5])))
    assert torch.equal(brand.grad.abs().sum(1) > 0, torch.isin(torch.arange(7), torch.tensor([3, 4, 6])))


def test_retrieval_s_item_batches_carry_each_item_s_features_from_the_source():
    from freescale.config import SyntheticDataConfig
    from freescale.data.synthetic import SyntheticSource
    from freescale.train.retrieval import item_batches

    source = SyntheticSource(SyntheticDataConfig(num_items=40, user_features=True, item_features=True), seed=0,
                             split="train", min_uih_len=1, max_uih_len=8, num_candidates=1)
    lo, batches = item_batches(40, rank=1, world_size=2, user_hash_size=5, source=source)
    ids = batches[0].item_ids
    assert lo == 20 and ids.tolist() == list(range(20, 40))
    genre = batches[0].item_side_features.to_dict()["item:cluster"]
    assert genre.values().tolist() == (ids % 16).tolist() and genre.lengths().tolist() == [1] * 20
    assert batches[0].user_side_features.to_dict()["user:clusters"].lengths().tolist() == [0]


@pytest.fixture(scope="module")
def one_rank():
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield


def test_torchrec_s_pipeline_distributes_the_side_features_a_batch_ahead(one_rank):
    """sparse_dist rewrites the side collections like the others: their input all-to-alls start
    with the batch before (the bitwise agreement with base: tests/dist/test_side_features.py)."""
    import torch.distributed as dist

    from freescale import compat
    from freescale.balance.balancer import NullBalancer
    from freescale.data.loader import BatchLoader, build_sources
    from freescale.distributed import Topology
    from freescale.profile.timeline import NullTimeline
    from freescale.train.training import build_training
    from helpers.launch import FAST, QUICKSTART

    cfg = load_config(QUICKSTART, [*FAST, "--data.synthetic.user_features=true", "--data.synthetic.item_features=true",
                                   "--model.side_features=[{name: user:clusters, dim: 8}, {name: item:cluster}]"])
    source, _ = build_sources(cfg.data, cfg.run.seed, task=cfg.task)
    topology = Topology(rank=0, world_size=1, local_rank=0, local_world_size=1)
    training = build_training(cfg, num_items=source.num_items, topology=topology, device=torch.device("cpu"),
                              side_layout=source.side_layout)
    pipeline = training.build_pipeline(torch.device("cpu"), NullTimeline(), group=dist.group.WORLD, replica=None)
    loader = BatchLoader(source, batch_size=cfg.data.batch_size, rank=0, world_size=1,
                         user_hash_size=cfg.model.user_hash_size)
    def side_state():
        state = training.model.state_dict()
        return {k: (v.local_shards()[0].tensor if hasattr(v, "local_shards") else v).clone()
                for k, v in state.items() if "side_ebc" in k or "task.join" in k}

    before = side_state()
    batches = NullBalancer(cfg.model.user_hash_size).batches(loader.iter_samples())
    pipeline.progress(batches)
    pipelined = compat.pipeline_forwards(pipeline.inner).modules
    model = training.model.module
    assert any(m is model.user_side_ebc for m in pipelined) and any(m is model.item_side_ebc for m in pipelined)
    # A step trains the side tables (their fused optimizer) and the join's projections (the dense one).
    pipeline.progress(batches)
    after = side_state()
    assert sorted(after) == sorted(before) and len(after) == 6  # two tables, two projections' weight and bias
    assert all(not torch.equal(before[k], after[k]) for k in after), [k for k in after if torch.equal(before[k], after[k])]
    # ... with embedding.optimizer, row-wise Adagrad: its per-row state is the optimizer's.
    state = training.optimizer.state_dict()["state"]
    for table in ("user_side_ebc.embedding_bags.user_clusters_table", "item_side_ebc.embedding_bags.item_cluster_table"):
        assert any(k.endswith("momentum1") for k in state[f"{table}.weight"]), state.get(f"{table}.weight")


def test_freescale_s_own_tables_feed_the_task_what_torchrec_s_collections_do(one_rank):
    """The owned model (every value a row, pooled in the dense part; a pooled item feature's
    candidate values alone sent) against the unsharded TorchRec model holding the same weights."""
    from freescale.distributed import Topology
    from freescale.embedding.pipeline import build_owned_model

    cfg = load_config(None, ["--model.embedding_dim=8", "--model.num_layers=1", "--model.mlp_dims=[8]",
                             "--data.max_uih_len=16", "--data.num_candidates=2",
                             "--model.side_features=[{name: item:brand}, {name: user:tags, pooling: mean}, "
                             "{name: item:genre, kind: sequence}, {name: user:age}]"])
    owned = build_owned_model(cfg, num_items=50, max_uih_len=16, side_layout=LAYOUT, seed=3,
                              topology=Topology(rank=0, world_size=1, local_rank=0, local_world_size=1))
    specs = side_specs(cfg.model, LAYOUT)
    assert owned.side == specs and owned.tables.names == ["item_table", "user_table", *(s.table for s in specs)]
    samples = Samples(sample_ids=np.arange(2), user_ids=np.array([3, 40]), uih_lengths=np.array([2, 1]),
                      uih_values=np.array([1, 2, 3]), uih_timestamps=np.arange(3), cand_counts=np.array([1, 2]),
                      cand_values=np.array([4, 5, 6]), cand_timestamps=np.full(3, 9), labels=np.ones((3, 1), np.float32),
                      side_layout=LAYOUT, user_side=np.array([[1, 4, 5, -1], [-1, -1, -1, -1]]),
                      uih_side=np.array([[3, 4, 0], [5, -1, 1], [-1, -1, 2]]),
                      cand_side=np.array([[6, 7, 3], [8, -1, 4], [9, 10, -1]]))
    batch = Batch.from_samples(samples, 0, user_hash_size=cfg.model.user_hash_size)
    segments = owned.segments(batch)
    # user:tags, user:age: every sample's values; item:genre: the events' and the candidates';
    # item:brand (pooled): the candidates' alone.
    assert [(t, ids.tolist()) for t, ids in segments[2:]] == [(2, [4, 5]), (3, [1]), (4, [3, 4, 5, 6, 7, 8, 9, 10]),
                                                             (5, [3, 4])]
    weight = owned.tables.weight.detach()
    rows = torch.cat([weight[owned.tables.locate(t, ids)[1]] for t, ids in segments])
    got, _ = owned.dense(batch, rows)

    torchrec = SeqRecModel(cfg.model, cfg.embedding, num_items=50, max_uih_len=16, device=torch.device("cpu"),
                           side_specs=specs)
    with torch.no_grad():
        def table(t):
            start = int(owned.tables.local_starts[0, t])
            return weight[start:start + owned.tables.rows[t]]

        torchrec.item_ec.embeddings["item_table"].weight.copy_(table(0))
        torchrec.user_ebc.embedding_bags["user_table"].weight.copy_(table(1))
        for t, spec in enumerate(specs, start=2):
            bags = torchrec.user_side_ebc if spec.user else torchrec.item_side_ebc
            bags.embedding_bags[spec.table].weight.copy_(table(t))
    torchrec.task.load_state_dict(owned.task.state_dict())
    want, _ = torchrec(batch)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_calibration_runs_the_model_with_its_side_features_every_slot_used():
    """user:clusters alone (no user-id row) and item:cluster: the model calibrated is the one trained."""
    from freescale.balance import calibrate as calibration

    cfg = load_config(None, ["--data.max_uih_len=16", "--data.num_candidates=2", "--model.num_layers=1",
                             "--model.embedding_dim=8", "--model.mlp_dims=[8]", "--data.batch_size=4",
                             "--model.user_features=false", "--data.synthetic.user_features=true",
                             "--data.synthetic.item_features=true",
                             "--model.side_features=[{name: user:clusters}, {name: item:cluster, kind: sequence}]"])
    layout = calibration._side_layout(cfg)
    batch = calibration._batch(3, 5, 2, 100, np.random.default_rng(0), 10, layout=layout)
    assert batch.user_side_features.lengths().tolist() == [2, 2, 2]  # clusters_per_user slots, every one used
    assert batch.item_side_features.lengths().tolist() == [1] * (3 * 5 + 3 * 2)
    model = calibration.calibrate(cfg, repeats=1, tokens_per_batch=64, log=lambda *_: None)
    assert np.isfinite(model.cost([4, 16], [1, 2])).all()
