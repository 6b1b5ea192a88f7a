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
