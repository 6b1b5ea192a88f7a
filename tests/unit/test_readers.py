import numpy as np
import pytest

from freescale.data.readers import DataError, RatingsSource, read_ratings

# user, item, rating, timestamp: user u1 has 6 events, u2 has 3, u3 has 1.
EVENTS = [
    ("u1", "i10", 5, 100), ("u1", "i11", 2, 101), ("u2", "i10", 4, 102), ("u1", "i12", 4, 103),
    ("u2", "i13", 1, 104), ("u1", "i10", 3, 105), ("u3", "i14", 5, 106), ("u1", "i15", 5, 107),
    ("u2", "i11", 5, 108), ("u1", "i13", 4, 109),
]


def write_csv(path, header=True, sep=",", events=EVENTS):
    lines = ["user,item,rating,timestamp"] if header else []
    lines += [sep.join(map(str, e)) for e in events]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("name, header, sep", [("r.csv", True, ","), ("r2.csv", False, ","), ("ratings.dat", False, "::"),
                                               ("u.data", False, "\t")])
def test_formats_parse_to_the_same_log(tmp_path, name, header, sep):
    # Shuffled file order: the reader must order by time itself.
    shuffled = [EVENTS[i] for i in np.random.default_rng(1).permutation(len(EVENTS))]
    log = read_ratings(str(write_csv(tmp_path / name, header, sep, shuffled)))
    assert len(log.users) == len(EVENTS)
    assert log.num_users == 3 and log.num_items == 6
    assert sorted(log.timestamps.tolist()) == [e[3] for e in EVENTS]


def items_of(name):
    return int(name[1:]) - 10  # i10..i15 -> contiguous 0..5 (sorted ids)


def test_samples_follow_each_users_timeline(tmp_path):
    log = read_ratings(str(write_csv(tmp_path / "r.csv")))
    src = RatingsSource(log, split="train", min_uih_len=1, max_uih_len=3, num_candidates=2, positive_rating=4,
                        holdout_fraction=0.0)
    s = src.samples_at(np.arange(src.num_samples))
    # u1 (time order): i10 i11 i12 i10 i15 i13 -> candidate groups at positions 1, 3, 5;
    # u2: i10 i13 i11 -> one group at 1; u3 has a single event and gives no sample.
    # Samples in the time order of their first candidate: u1@101, u2@104, u1@105, u1@109.
    expect = [
        (["i10"], ["i11", "i12"], [0, 1]),
        (["i10"], ["i13", "i11"], [0, 1]),
        (["i10", "i11", "i12"], ["i10", "i15"], [0, 1]),
        (["i12", "i10", "i15"], ["i13"], [1]),  # history capped at the 3 most recent events
    ]
    split = lambda values, lengths: [v.tolist() for v in np.split(values, np.cumsum(lengths)[:-1])]
    got = list(zip(split(s.uih_values, s.uih_lengths), split(s.cand_values, s.cand_counts),
                   split(s.labels[:, 0].astype(int), s.cand_counts)))
    want = [([items_of(x) for x in u], [items_of(x) for x in c], l) for u, c, l in expect]
    assert got == [tuple(w) for w in want]
    np.testing.assert_array_equal(s.sample_ids, np.arange(4))
    np.testing.assert_array_equal(s.user_ids, [0, 1, 0, 0])


def test_holdout_is_the_latest_samples_and_ids_continue(tmp_path):
    log = read_ratings(str(write_csv(tmp_path / "r.csv")))
    kw = dict(min_uih_len=1, max_uih_len=10, num_candidates=1, positive_rating=4, holdout_fraction=0.25)
    train = RatingsSource(log, split="train", **kw)
    held = RatingsSource(log, split="eval", **kw)
    assert train.num_samples + held.num_samples == len(EVENTS) - 3  # one event per user has no history
    t = train.samples_at(np.arange(train.num_samples))
    e = held.samples_at(np.arange(held.num_samples))
    np.testing.assert_array_equal(e.sample_ids, train.num_samples + np.arange(held.num_samples))
    # The two latest candidates in time (u1's i13 at 109, u2's i11 at 108) are held out.
    assert held.num_samples == 2
    assert len(set(t.sample_ids) & set(e.sample_ids)) == 0
    assert sorted(e.cand_values.tolist()) == sorted([items_of("i11"), items_of("i13")])


def test_bad_files(tmp_path):
    with pytest.raises(DataError, match="ratings file not found: .*nope.csv"):
        read_ratings(str(tmp_path / "nope.csv"))
    bad = tmp_path / "bad.csv"
    bad.write_text("1,2,3,4\n1,2,3\n")
    with pytest.raises(DataError, match=r"bad.csv:2: expected 4 fields"):
        read_ratings(str(bad))
    text = tmp_path / "text.dat"
    text.write_text("1::2::5::100\n1::3::five::101\n")
    with pytest.raises(DataError, match=r"text.dat:2: rating and timestamp must be numbers"):
        read_ratings(str(text))
    empty = tmp_path / "empty.csv"
    empty.write_text("\n")
    with pytest.raises(DataError, match="no ratings found"):
        read_ratings(str(empty))


def by_time():
    """The test log's events keyed by their (unique) time: (user, item index, rating)."""
    return {t: (u, items_of(i), r) for u, i, r, t in EVENTS}


def test_times_and_labels_are_the_logs(tmp_path):
    log = read_ratings(str(write_csv(tmp_path / "r.csv")))
    src = RatingsSource(log, split="train", min_uih_len=1, max_uih_len=3, num_candidates=2, positive_rating=4,
                        more_labels=(5, 2), holdout_fraction=0.0)
    s = src.samples_at(np.arange(src.num_samples))
    assert s.uih_timestamps.dtype == s.cand_timestamps.dtype == np.int64
    assert s.labels.shape == (len(s.cand_values), 3) and s.labels.dtype == np.float32
    events = by_time()
    users = {"u1": 0, "u2": 1, "u3": 2}
    for values, times, owners in ((s.uih_values, s.uih_timestamps, np.repeat(s.user_ids, s.uih_lengths)),
                                  (s.cand_values, s.cand_timestamps, np.repeat(s.user_ids, s.cand_counts))):
        assert [(users[events[t][0]], events[t][1]) for t in times.tolist()] == list(zip(owners.tolist(), values.tolist()))
    ratings = np.array([events[t][2] for t in s.cand_timestamps.tolist()])
    np.testing.assert_array_equal(s.labels, np.stack([ratings >= 4, ratings >= 5, ratings >= 2], axis=1))


# A hand-made log for leave-one-out: u1 has 8 events, u2 3, u3 1, u4 2 (times interleaved, file shuffled).
LOO_EVENTS = (
    [("u1", f"i{k}", 5, 1000 + 10 * k) for k in range(8)]
    + [("u2", "i3", 4, 1005), ("u2", "i9", 1, 1041), ("u2", "i4", 3, 1077)]
    + [("u3", "i2", 5, 1003)]
    + [("u4", "i8", 2, 1012), ("u4", "i1", 5, 1013)]
)


def loo_sources(tmp_path, min_uih_len=1, max_uih_len=2, negatives=4, seed=0, stride=0):
    shuffled = [LOO_EVENTS[i] for i in np.random.default_rng(2).permutation(len(LOO_EVENTS))]
    log = read_ratings(str(write_csv(tmp_path / "loo.csv", events=shuffled)))
    kw = dict(min_uih_len=min_uih_len, max_uih_len=max_uih_len, num_candidates=3, positive_rating=4,
              holdout_fraction=0.5, task="retrieval", num_negatives=negatives, seed=seed, window_stride=stride)
    train, held = (RatingsSource(log, split=s, **kw) for s in ("train", "eval"))
    return log, train, held, train.samples_at(np.arange(train.num_samples)), held.samples_at(np.arange(held.num_samples))


def timelines():
    """Each user's event times, oldest first, computed from the list directly."""
    out = {}
    for u, _, _, t in sorted(LOO_EVENTS, key=lambda e: e[3]):
        out.setdefault(u, []).append(t)
    return out


def per_sample(values, lengths):
    return [v.tolist() for v in np.split(values, np.cumsum(lengths)[:-1])]


def test_retrieval_eval_is_each_users_last_event(tmp_path):
    log, train, held, t, e = loo_sources(tmp_path)
    lines = timelines()
    # One sample per user with two events or more; candidate = the last event, history = the two before.
    want = sorted((line[-1], line[-3:-1]) for line in lines.values() if len(line) >= 2)
    got = sorted(zip(e.cand_timestamps.reshape(-1, 5)[:, 0].tolist(), per_sample(e.uih_timestamps, e.uih_lengths)))
    assert got == want
    assert (e.cand_timestamps.reshape(-1, 5) == e.cand_timestamps.reshape(-1, 5)[:, :1]).all()
    events = by_time_loo()
    np.testing.assert_array_equal(e.cand_values.reshape(-1, 5)[:, 0], [events[x] for x in e.cand_timestamps[::5]])
    np.testing.assert_array_equal(e.uih_values, [events[x] for x in e.uih_timestamps])
    np.testing.assert_array_equal(e.labels, np.tile([[1.0], [0], [0], [0], [0]], (held.num_samples, 1)))
    # Time order of the candidate, ids after the train split's.
    assert (np.diff(e.cand_timestamps[::5]) > 0).all()
    np.testing.assert_array_equal(e.sample_ids, train.num_samples + np.arange(held.num_samples))


def test_retrieval_eval_leaves_out_the_whole_timeline_not_only_the_history(tmp_path):
    """The held-out batches carry each user's every item before the target (u1: seven, of which its
    history holds max_uih_len = 2): what ``exclude_history`` leaves out of the ranking."""
    from freescale.data.loader import eval_batches
    from freescale.train.retrieval import held_out_users

    _, _, held, _, _ = loo_sources(tmp_path)
    keys = sorted({i for _, i, _, _ in LOO_EVENTS})
    items: dict = {}
    for u, i, _, _ in sorted(LOO_EVENTS, key=lambda e: e[3]):
        items.setdefault(u, []).append(keys.index(i))
    want = sorted(line[:-1] for line in items.values() if len(line) >= 2)
    batches = eval_batches(held, num_samples=100, batch_size=2, rank=0, world_size=1, user_hash_size=10)
    got = sorted(h.tolist() for b in batches for h in held_out_users(b)[2])
    assert got == want and max(map(len, got)) == 7


def by_time_loo():
    keys = sorted({i for _, i, _, _ in LOO_EVENTS})
    return {t: keys.index(i) for _, i, _, t in LOO_EVENTS}


def test_retrieval_train_windows_target_every_event_once(tmp_path):
    log, train, held, t, e = loo_sources(tmp_path)
    lines = timelines()
    histories = per_sample(t.uih_timestamps, t.uih_lengths)
    candidates = t.cand_timestamps.reshape(-1, 5)[:, 0].tolist()
    targets = []
    owner_line = {x: line for line in lines.values() for x in line}
    for history, cand in zip(histories, candidates):
        line = owner_line[cand]
        assert 1 <= len(history) <= 2
        # A window is consecutive events of one user: the history, then its candidate.
        start = line.index(cand) - len(history)
        assert line[start:start + len(history) + 1] == history + [cand]
        targets += history[1:] + [cand]  # what history positions and the candidate predict
    # Every event but each user's first and last is a target exactly once; the last never.
    want = sorted(x for line in lines.values() for x in line[1:-1])
    assert sorted(targets) == want
    assert (np.diff(candidates) > 0).all()  # time order of the candidate
    np.testing.assert_array_equal(t.sample_ids, np.arange(train.num_samples))
    np.testing.assert_array_equal(t.labels[::5, 0], 1.0)
    # Windows of max_uih_len + 1 events step back from u1's second-to-last event (1060); the
    # earliest, with 2 history events, is kept with min_uih_len 2 and dropped with 3.
    for min_len, want in ((2, [(1020, [1000, 1010]), (1060, [1020, 1030, 1040, 1050])]),
                          (3, [(1060, [1020, 1030, 1040, 1050])])):
        _, _, _, w, _ = loo_sources(tmp_path, min_uih_len=min_len, max_uih_len=4)
        assert list(zip(w.cand_timestamps[::5].tolist(), per_sample(w.uih_timestamps, w.uih_lengths))) == want
    # task.window_stride 2: windows end 2 events apart (targets repeat), each as long as max_uih_len allows.
    _, _, _, w, _ = loo_sources(tmp_path, min_uih_len=2, max_uih_len=4, stride=2)
    u1 = [x for x in list(zip(w.cand_timestamps[::5].tolist(), per_sample(w.uih_timestamps, w.uih_lengths)))
          if x[0] in (1020, 1040, 1060)]
    assert u1 == [(1020, [1000, 1010]), (1040, [1000, 1010, 1020, 1030]), (1060, [1020, 1030, 1040, 1050])]


def test_retrieval_negatives_are_deterministic_and_in_the_table(tmp_path):
    log, train, _, t, _ = loo_sources(tmp_path, negatives=50)
    _, _, _, again, _ = loo_sources(tmp_path, negatives=50)
    _, _, _, other, _ = loo_sources(tmp_path, negatives=50, seed=1)
    negatives = t.cand_values.reshape(-1, 51)[:, 1:]
    assert negatives.min() >= 0 and negatives.max() < log.num_items
    assert len(np.unique(negatives)) == log.num_items  # 50 draws per sample reach the whole (small) table
    np.testing.assert_array_equal(again.cand_values, t.cand_values)
    # A sample read alone has the negatives it has in a batch.
    np.testing.assert_array_equal(train.samples_at(np.array([2])).cand_values, negatives_row(t, 2))
    assert not np.array_equal(other.cand_values, t.cand_values)
    assert not np.array_equal(negatives[0], negatives[1])


def negatives_row(s, i):
    return s.cand_values.reshape(-1, 51)[i]
