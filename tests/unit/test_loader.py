import numpy as np

from freescale.config import SyntheticDataConfig
from freescale.data.batch import CANDIDATE_FEATURE, UIH_FEATURE, Batch
from freescale.data.loader import BatchLoader, eval_batches
from freescale.data.readers import RatingsSource, read_ratings
from freescale.data.synthetic import SyntheticSource


def synthetic(split="train"):
    return SyntheticSource(SyntheticDataConfig(), seed=1, split=split, min_uih_len=1, max_uih_len=256, num_candidates=2)


def loader(rank, world, src=None, **kw):
    return BatchLoader(src or synthetic(), batch_size=8, rank=rank, world_size=world, user_hash_size=1000, **kw)


def take(it, n):
    return [next(it) for _ in range(n)]


def test_ranks_split_each_global_batch_contiguously():
    world = 3
    per_rank = [take(iter(loader(r, world)), 4) for r in range(world)]
    for step in range(4):
        ids = np.concatenate([per_rank[r][step].sample_ids.numpy() for r in range(world)])
        np.testing.assert_array_equal(ids, np.arange(step * 24, (step + 1) * 24))
        assert all(int(per_rank[r][step].batch_index) == step for r in range(world))


def test_batch_tensors_match_samples():
    b = next(iter(loader(0, 1)))
    s = synthetic().samples_at(np.arange(8))
    kjt = b.seq_features.to_dict()
    np.testing.assert_array_equal(kjt[UIH_FEATURE].values().numpy(), s.uih_values)
    np.testing.assert_array_equal(kjt[UIH_FEATURE].lengths().numpy(), s.uih_lengths)
    np.testing.assert_array_equal(kjt[CANDIDATE_FEATURE].values().numpy(), s.cand_values)
    np.testing.assert_array_equal(b.labels.numpy(), s.labels)
    assert b.labels.shape == (len(s.cand_values), 1)
    assert isinstance(b.to("cpu"), Batch)


def test_state_dict_resumes_the_same_stream():
    a = loader(1, 2)
    it = iter(a)
    take(it, 3)
    state = a.state_dict()
    assert state == {"next_batch": 3}
    expected = take(it, 2)
    b = loader(1, 2)
    b.load_state_dict(state)
    resumed = take(iter(b), 2)
    for x, y in zip(expected, resumed):
        np.testing.assert_array_equal(x.sample_ids.numpy(), y.sample_ids.numpy())
        np.testing.assert_array_equal(x.seq_features.values().numpy(), y.seq_features.values().numpy())


def test_finite_source_wraps_into_epochs(tmp_path):
    path = tmp_path / "r.csv"
    rows = [f"{u},{i},{(u + i) % 5 + 1},{t}" for t, (u, i) in enumerate((u, i) for u in range(6) for i in range(5))]
    path.write_text("\n".join(rows) + "\n")
    src = RatingsSource(read_ratings(str(path)), split="train", min_uih_len=1, max_uih_len=8, num_candidates=1,
                        positive_rating=4, holdout_fraction=0.0)
    assert src.num_samples == 24
    batches = take(iter(loader(0, 1, src)), 4)  # 32 samples from 24: the stream wraps
    ids = np.concatenate([b.sample_ids.numpy() for b in batches])
    np.testing.assert_array_equal(ids, np.arange(32) % 24)


def test_eval_batches_are_equal_across_ranks_and_disjoint():
    src = synthetic("eval")
    shares = [eval_batches(src, num_samples=50, batch_size=8, rank=r, world_size=3, user_hash_size=1000)
              for r in range(3)]
    assert len({len(s) for s in shares}) == 1  # every rank runs the same number of forwards
    ids = [np.concatenate([b.sample_ids.numpy() for b in s]) for s in shares]
    assert all(len(i) == 16 for i in ids)
    assert len(np.unique(np.concatenate(ids))) == 48


def test_stream_positions_count_across_epochs():
    # A finite source of 10 samples, 2 ranks of 3: global batch 2 holds positions 12..17, which
    # wrap to samples 2..7; the positions themselves go on counting (the dropout key).
    from freescale.data.loader import BatchLoader

    class Finite:
        num_items, num_samples = 5, 10

        def samples_at(self, positions):
            from freescale.data.batch import Samples
            n = len(positions)
            return Samples(sample_ids=np.asarray(positions), user_ids=np.zeros(n, np.int64),
                           uih_lengths=np.ones(n, np.int64), uih_values=np.zeros(n, np.int64),
                           uih_timestamps=np.zeros(n, np.int64), cand_counts=np.ones(n, np.int64),
                           cand_values=np.zeros(n, np.int64), cand_timestamps=np.zeros(n, np.int64),
                           labels=np.zeros((n, 1), np.float32))

    got = BatchLoader(Finite(), batch_size=3, rank=1, world_size=2, user_hash_size=10).local_samples(2)
    assert got.sample_ids.tolist() == [5, 6, 7]
    assert got.stream_positions.tolist() == [15, 16, 17]
