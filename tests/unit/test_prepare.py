"""``freescale prepare``'s samples against the reader's (``RatingsSource``) and the synthetic
stream's, read back with pyarrow alone: same ids, users, histories (items, times, actions),
candidates, labels, seen items and order, for both tasks and both splits."""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from freescale.config import SyntheticDataConfig
from freescale.data.log_formats import LogOptions
from freescale.data.ml100k import ensure_ml100k
from freescale.data.prepare import Engine, Layout, SampleSettings, memory_bytes, prepare_log, prepare_synthetic
from freescale.data.readers import RatingsSource, read_ratings
from freescale.data.synthetic import SyntheticSource

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CACHE = os.path.join(REPO, "runs", "cache")


def quiet(message):
    pass


def read_split(folder, split):
    manifest = json.load(open(os.path.join(folder, "manifest.json")))
    files = manifest["splits"][split]["files"]
    table = pa.concat_tables([pq.read_table(os.path.join(folder, f["path"])) for f in files])
    assert table.num_rows == manifest["splits"][split]["rows"]
    return table


def lists(table, column):
    """(lengths, values) of a list column."""
    col = table.column(column).combine_chunks()
    return col.value_lengths().to_numpy(zero_copy_only=False), col.flatten().to_numpy(zero_copy_only=False)


def ratings_of(log, settings):
    """Each history event's rating, in the reader's event order (the action prepare stores)."""
    order = np.lexsort((np.arange(len(log.users)), log.timestamps, log.users))
    return log.ratings[order]


def assert_same_samples(folder, log_path, settings):
    """Every split of the dataset at ``folder`` equals ``RatingsSource``'s over ``log_path``."""
    log = read_ratings(log_path)
    for split in ("train", "eval"):
        src = RatingsSource(log, split=split, min_uih_len=settings.min_uih_len, max_uih_len=settings.max_uih_len,
                            num_candidates=settings.num_candidates, positive_rating=settings.positive_rating,
                            holdout_fraction=settings.holdout_fraction, more_labels=settings.more_labels,
                            task=settings.task, window_stride=settings.window_stride)
        positions = np.arange(src.num_samples)
        want = src.samples_at(positions)
        got = read_split(folder, split)
        assert got.num_rows == src.num_samples
        np.testing.assert_array_equal(got.column("sample_id").to_numpy(), want.sample_ids)
        np.testing.assert_array_equal(got.column("user_id").to_numpy(), want.user_ids)
        lengths, items = lists(got, "uih_items")
        np.testing.assert_array_equal(lengths, want.uih_lengths)
        np.testing.assert_array_equal(items, want.uih_values)
        np.testing.assert_array_equal(lists(got, "uih_times")[1], want.uih_timestamps)
        # Actions: the rating of each history event (the reader keeps only the labels).
        uih_idx = np.concatenate([np.arange(s - n, s) for s, n in zip(src._cand_start, src._uih_len)])
        np.testing.assert_array_equal(lists(got, "uih_actions")[1],
                                      ratings_of(log, settings)[uih_idx].astype(np.float32))
        counts, cands = lists(got, "cand_items")
        if settings.task == "retrieval":
            # The stored candidate is the next item alone; the reader's first candidate.
            np.testing.assert_array_equal(counts, 1)
            first = np.cumsum(want.cand_counts) - want.cand_counts
            np.testing.assert_array_equal(cands, want.cand_values[first])
            np.testing.assert_array_equal(lists(got, "cand_times")[1], want.cand_timestamps[first])
            np.testing.assert_array_equal(lists(got, "label:next_item")[1], 1.0)
            if split == "eval":
                seen = src.seen_items(positions)
                seen_lengths, seen_items = lists(got, "seen_items")
                np.testing.assert_array_equal(seen_lengths, [len(s) for s in seen])
                np.testing.assert_array_equal(seen_items, np.concatenate(seen))
            else:
                assert "seen_items" not in got.column_names
        else:
            np.testing.assert_array_equal(counts, want.cand_counts)
            np.testing.assert_array_equal(cands, want.cand_values)
            np.testing.assert_array_equal(lists(got, "cand_times")[1], want.cand_timestamps)
            thresholds = [settings.positive_rating, *settings.more_labels]
            assert [c for c in got.column_names if c.startswith("label:")] == [f"label:rating>={t:g}" for t in thresholds]
            for k, t in enumerate(thresholds):
                np.testing.assert_array_equal(lists(got, f"label:rating>={t:g}")[1], want.labels[:, k])


@pytest.fixture(scope="module")
def ml100k():
    return ensure_ml100k(CACHE)


def test_ml100k_ranking_with_more_labels_equals_the_reader(tmp_path, ml100k):
    settings = SampleSettings(min_uih_len=3, max_uih_len=50, num_candidates=10, more_labels=(5.0, 2.0),
                              holdout_fraction=0.15)
    prepare_log(str(tmp_path / "ds"), "ml100k", [ml100k], settings, layout=Layout(rows_per_file=3000, rows_per_group=700),
                say=quiet)
    manifest = json.load(open(tmp_path / "ds" / "manifest.json"))
    assert len(manifest["splits"]["train"]["files"]) > 1  # rows cross files
    assert manifest["labels"] == ["rating>=4", "rating>=5", "rating>=2"]
    assert (manifest["num_users"], manifest["num_items"]) == (943, 1682)
    assert_same_samples(str(tmp_path / "ds"), ml100k, settings)


@pytest.mark.parametrize("stride", [0, 10])
def test_ml100k_retrieval_equals_the_reader(tmp_path, ml100k, stride):
    settings = SampleSettings(task="retrieval", min_uih_len=2, max_uih_len=50, window_stride=stride)
    prepare_log(str(tmp_path / "ds"), "ml100k", [ml100k], settings, say=quiet)
    assert_same_samples(str(tmp_path / "ds"), ml100k, settings)


@pytest.mark.parametrize("settings", [
    SampleSettings(min_uih_len=3, max_uih_len=50, num_candidates=10, more_labels=(5.0,)),
    SampleSettings(task="retrieval", min_uih_len=2, max_uih_len=50, window_stride=10),
], ids=["ranking", "retrieval"])
def test_users_cut_in_buckets_give_the_same_samples(tmp_path, ml100k, settings):
    # A small memory limit cuts the users in buckets (DuckDB cannot spill grouped lists).
    said = []
    prepare_log(str(tmp_path / "ds"), "ml100k", [ml100k], settings, engine=Engine(memory_limit="30MB"), say=said.append)
    assert any("in 3 bucket(s) of users" in line for line in said), said
    assert_same_samples(str(tmp_path / "ds"), ml100k, settings)


def write_shuffled_log(path, seed=0):
    """A CSV with string ids ("u10" sorts before "u9"), times on half seconds (rint rounds half to
    even) with ties inside a user's timeline (file order breaks them), in shuffled line order."""
    rng = np.random.default_rng(seed)
    rows = []
    for u in range(14):
        for _ in range(int(rng.integers(1, 40))):
            rows.append((f"u{u}", f"i{int(rng.integers(0, 30))}", int(rng.integers(1, 6)), float(rng.integers(0, 24)) / 2))
    rows = [rows[i] for i in rng.permutation(len(rows))]
    path.write_text("user,item,rating,timestamp\n" + "".join(f"{u},{i},{r},{t:g}\n" for u, i, r, t in rows))
    return str(path)


@pytest.mark.parametrize("settings", [
    SampleSettings(min_uih_len=1, max_uih_len=5, num_candidates=3, more_labels=(5.0,), holdout_fraction=0.3),
    SampleSettings(min_uih_len=4, max_uih_len=4, num_candidates=1, holdout_fraction=0.5),
    SampleSettings(task="retrieval", min_uih_len=1, max_uih_len=6),
    SampleSettings(task="retrieval", min_uih_len=2, max_uih_len=6, window_stride=2),
], ids=["ranking", "ranking-min-is-max", "retrieval", "retrieval-stride"])
def test_shuffled_csv_with_ties_and_string_ids_equals_the_reader(tmp_path, settings):
    log = write_shuffled_log(tmp_path / "log.csv")
    # The file has ties and half seconds that rint rounds to even: what the test is about.
    times = np.array([float(line.split(",")[3]) for line in open(log).read().splitlines()[1:]])
    assert np.any(times % 1 == 0.5) and np.any(np.rint(times) != np.floor(times + 0.5))
    prepare_log(str(tmp_path / "ds"), "csv", [log], settings, layout=Layout(rows_per_group=7), say=quiet)
    assert_same_samples(str(tmp_path / "ds"), log, settings)


def test_integer_ids_of_a_parquet_log_map_in_the_order_of_their_text(tmp_path):
    log = write_shuffled_log(tmp_path / "log.csv")
    rows = [line.split(",") for line in open(log).read().splitlines()[1:]]
    # The same log as Parquet with integer ids: 10 sorts before 9, as "u10" before "u9".
    pq.write_table(pa.table({"user": pa.array([int(r[0][1:]) for r in rows], pa.int32()),
                             "item": pa.array([int(r[1][1:]) for r in rows]),
                             "rating": [float(r[2]) for r in rows], "time": [float(r[3]) for r in rows]}),
                   tmp_path / "log.parquet")
    settings = SampleSettings(min_uih_len=1, max_uih_len=5, num_candidates=2)
    prepare_log(str(tmp_path / "ds"), "events", [str(tmp_path / "log.parquet")], settings, say=quiet,
                options=LogOptions(columns={"user": "user", "item": "item", "time": "time", "rating": "rating"}))
    assert_same_samples(str(tmp_path / "ds"), log, settings)


@pytest.mark.parametrize("task", ["ranking", "retrieval"])
def test_samples_at_the_same_time_follow_the_user_order(tmp_path, task):
    # Every user's events at the same three times: every sample ties on time with the others'.
    log = tmp_path / "log.csv"
    users = np.random.default_rng(0).permutation(60)
    log.write_text("".join(f"u{u},i{(u + k) % 7},{1 + k},{10 + k}\n" for k in range(3) for u in users))
    settings = SampleSettings(task=task, min_uih_len=1, num_candidates=1, holdout_fraction=0.5)
    prepare_log(str(tmp_path / "ds"), "csv", [str(log)], settings, say=quiet)
    assert_same_samples(str(tmp_path / "ds"), str(log), settings)


def test_ids_map_in_the_sorted_order_of_their_text(tmp_path):
    log = tmp_path / "log.csv"
    log.write_text("u9,b,5,1\nu10,a,5,2\nu9,c,5,3\nu10,b,5,4\n")
    prepare_log(str(tmp_path / "ds"), "csv", [str(log)], SampleSettings(min_uih_len=1, num_candidates=1,
                                                                        holdout_fraction=0.5), say=quiet)
    train, held = read_split(str(tmp_path / "ds"), "train"), read_split(str(tmp_path / "ds"), "eval")
    # "u10" < "u9" and a < b < c as text: u10 is user 0, u9 user 1.
    assert train.select(["sample_id", "user_id", "uih_items", "cand_items"]).to_pylist() == [
        {"sample_id": 0, "user_id": 1, "uih_items": [1], "cand_items": [2]}]
    assert held.select(["sample_id", "user_id", "uih_items", "cand_items"]).to_pylist() == [
        {"sample_id": 1, "user_id": 0, "uih_items": [0], "cand_items": [1]}]


def test_synthetic_rows_equal_the_stream(tmp_path):
    cfg = SyntheticDataConfig(num_items=5000, median_uih_len=12, tail_min_len=40, num_labels=2)
    settings = SampleSettings(min_uih_len=2, max_uih_len=64, num_candidates=3)
    prepare_synthetic(str(tmp_path / "ds"), 5000, 300, cfg, seed=7, settings=settings, say=quiet)
    for split, n in (("train", 5000), ("eval", 300)):
        want = SyntheticSource(cfg, seed=7, split=split, min_uih_len=2, max_uih_len=64, num_candidates=3).samples_at(np.arange(n))
        got = read_split(str(tmp_path / "ds"), split)
        np.testing.assert_array_equal(got.column("sample_id").to_numpy(), want.sample_ids)
        np.testing.assert_array_equal(got.column("user_id").to_numpy(), want.user_ids)
        np.testing.assert_array_equal(lists(got, "uih_items")[0], want.uih_lengths)
        np.testing.assert_array_equal(lists(got, "uih_items")[1], want.uih_values)
        np.testing.assert_array_equal(lists(got, "uih_times")[1], want.uih_timestamps)
        np.testing.assert_array_equal(lists(got, "cand_items")[1], want.cand_values)
        np.testing.assert_array_equal(lists(got, "cand_times")[1], want.cand_timestamps)
        np.testing.assert_array_equal(lists(got, "label:click")[1], want.labels[:, 0])
        np.testing.assert_array_equal(lists(got, "label:liked")[1], want.labels[:, 1])


def test_synthetic_retrieval_stores_the_next_item_alone(tmp_path):
    cfg = SyntheticDataConfig(num_items=3000, median_uih_len=8, tail_min_len=20)
    settings = SampleSettings(task="retrieval", max_uih_len=32)
    prepare_synthetic(str(tmp_path / "ds"), 4500, 100, cfg, seed=3, settings=settings, say=quiet)
    want = SyntheticSource(cfg, seed=3, split="train", min_uih_len=1, max_uih_len=32, num_candidates=4,
                           task="retrieval", num_negatives=5).samples_at(np.arange(4500))
    got = read_split(str(tmp_path / "ds"), "train")
    counts, cands = lists(got, "cand_items")
    np.testing.assert_array_equal(counts, 1)
    np.testing.assert_array_equal(cands, want.cand_values[::6])  # the positive, before its 5 negatives
    np.testing.assert_array_equal(lists(got, "uih_items")[1], want.uih_values)
    assert json.load(open(tmp_path / "ds" / "manifest.json"))["labels"] == ["next_item"]


def test_up_to_date_only_for_the_same_inputs_and_settings(tmp_path):
    log = write_shuffled_log(tmp_path / "log.csv")
    out = str(tmp_path / "ds")
    settings = SampleSettings(max_uih_len=8)
    assert not prepare_log(out, "csv", [log], settings, say=quiet).up_to_date
    assert prepare_log(out, "csv", [log], settings, say=quiet).up_to_date
    assert not prepare_log(out, "csv", [log], SampleSettings(max_uih_len=9), say=quiet).up_to_date
    assert not prepare_log(out, "csv", [log], SampleSettings(max_uih_len=9), layout=Layout(rows_per_group=5),
                           say=quiet).up_to_date
    st = os.stat(log)
    os.utime(log, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # the same bytes, touched
    assert not prepare_log(out, "csv", [log], SampleSettings(max_uih_len=9), layout=Layout(rows_per_group=5),
                           say=quiet).up_to_date


@pytest.mark.parametrize("task", ["ranking", "retrieval"])
def test_side_features_follow_each_user_and_item(tmp_path, task):
    log = tmp_path / "log.csv"
    # Users "10", "7", "9" are 0, 1, 2 (text order); "7" has no line in the user file, item "c" none in the item file.
    log.write_text("".join(f"{u},{i},4,{t}\n" for t, (u, i) in enumerate(
        [("9", "a"), ("10", "b"), ("7", "c"), ("9", "b"), ("10", "a"), ("7", "a"), ("9", "c"), ("10", "c"), ("7", "b")])))
    users = tmp_path / "u.user"
    users.write_text("9|30|M|writer|1\n10|20|F|artist|2\n11|60|F|doctor|3\n")
    items = tmp_path / "u.item"
    flags = lambda *on: "|".join("1" if g in on else "0" for g in range(19))  # noqa: E731
    items.write_text(f"a|A (1990)|01-Jan-1990||u|{flags(1, 2)}\nb|B (2001)|01-Jan-2001||u|{flags(8)}\n")
    settings = SampleSettings(task=task, min_uih_len=1, num_candidates=1, holdout_fraction=0.5)
    prepare_log(str(tmp_path / "ds"), "csv", [str(log)], settings, users=str(users), items=str(items), say=quiet)
    manifest = json.load(open(tmp_path / "ds" / "manifest.json"))
    assert [(f["name"], f["num_values"]) for f in manifest["user_features"]] == [("age", 7), ("gender", 2), ("occupation", 3)]
    # gender: F < M; occupation: artist < doctor < writer (over the whole file); age 20 -> 1, 30 -> 2.
    want = {0: {"user:age": [1], "user:gender": [0], "user:occupation": [0]},
            1: {"user:age": [], "user:gender": [], "user:occupation": []},
            2: {"user:age": [2], "user:gender": [1], "user:occupation": [2]}}
    seen = set()
    for split in ("train", "eval"):
        for row in read_split(str(tmp_path / "ds"), split).to_pylist():
            assert {k: row[k] for k in want[0]} == want[row["user_id"]]
            seen.add(row["user_id"])
    assert seen == {0, 1, 2}
    items_table = pq.read_table(tmp_path / "ds" / "items.parquet").to_pylist()
    # genre: Action (1) < Adventure (2) < Drama (8) as names; year 1990 -> 8, 2001 -> 10.
    assert items_table == [{"item_id": 0, "item:genre": [0, 1], "item:year": [8]},
                           {"item_id": 1, "item:genre": [2], "item:year": [10]},
                           {"item_id": 2, "item:genre": [], "item:year": []}]


def test_kuairand_labels_are_the_signals_of_each_candidate(tmp_path):
    header = ("user_id,video_id,date,hourmin,time_ms,is_click,is_like,is_follow,is_comment,is_forward,is_hate,long_view,"
              "play_time_ms,duration_ms,profile_stay_time,comment_stay_time,is_profile_enter,is_rand,tab")
    rng = np.random.default_rng(0)
    rows = [(u, int(rng.integers(0, 9)), 1_650_000_000_000 + 1000 * k, *rng.integers(0, 2, 3)) for k in range(60)
            for u in range(3)]
    (tmp_path / "log_standard_1k.csv").write_text(header + "\n" + "".join(
        f"{u},{v},0,0,{t},{click},{like},0,0,0,0,{long},0,0,0,0,0,0,1\n" for u, v, t, click, like, long in rows))
    settings = SampleSettings(min_uih_len=1, num_candidates=1, holdout_fraction=0.0)
    with pytest.raises(Exception, match="no ranking eval samples"):
        prepare_log(str(tmp_path / "ds"), "kuairand", [str(tmp_path / "log_standard_1k.csv")], settings, say=quiet)
    settings = SampleSettings(min_uih_len=1, num_candidates=1, holdout_fraction=0.2)
    prepare_log(str(tmp_path / "ds"), "kuairand", [str(tmp_path / "log_standard_1k.csv")], settings,
                options=LogOptions(signals=("long_view", "is_click")), say=quiet)
    assert json.load(open(tmp_path / "ds" / "manifest.json"))["labels"] == ["long_view", "is_click"]
    signals = {(u, t // 1000): (long, click) for u, v, t, click, like, long in rows}
    for split in ("train", "eval"):
        for row in read_split(str(tmp_path / "ds"), split).to_pylist():
            long, click = signals[(row["user_id"], row["cand_times"][0])]
            assert (row["label:long_view"], row["label:is_click"]) == ([float(long)], [float(click)])
            assert row["uih_actions"] == [float(signals[(row["user_id"], t)][0] + 2 * signals[(row["user_id"], t)][1])
                                          for t in row["uih_times"]]


def test_memory_sizes_read_as_duckdb_writes_them():
    assert memory_bytes("953.6 MiB") == int(953.6 * 2**20)
    assert memory_bytes("2GB") == 2 * 10**9 and memory_bytes("1.5 GiB") == 3 * 2**29 and memory_bytes("512 KiB") == 2**19


def test_samples_of_a_user_at_one_time_follow_their_position(tmp_path):
    # Thousands of a user's samples tie on time and user: only the position orders them (DuckDB's
    # sort and parallel windows do not keep it by themselves at this size).
    rng = np.random.default_rng(0)
    log = tmp_path / "log.csv"
    log.write_text("".join(f"u{u},i{rng.integers(0, 500)},{rng.integers(1, 6)},7\n" for u in range(4) for _ in range(8000)))
    settings = SampleSettings(min_uih_len=1, max_uih_len=4, num_candidates=1, holdout_fraction=0.5)
    prepare_log(str(tmp_path / "ds"), "csv", [str(log)], settings, say=quiet)
    assert_same_samples(str(tmp_path / "ds"), str(log), settings)
