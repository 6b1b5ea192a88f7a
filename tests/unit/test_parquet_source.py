"""The Parquet sample reader against the in-memory ratings reader it replaces.

A ratings log's samples are written into sample files (several files, small row groups) with the
format's writer, read back by ``ParquetSource`` at shuffled positions, and compared field by
field with ``RatingsSource``'s samples at the same positions; retrieval's negatives are drawn at
read time and must be the same draws. Bad files fail with one line naming the file.
"""

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from freescale.data.parquet_source import ParquetSource
from freescale.data.readers import RatingsSource, read_ratings
from freescale.data.sample_files import DatasetWriter, Manifest, SampleFileError, sample_schema, samples_table

FIELDS = ("sample_ids", "user_ids", "uih_lengths", "uih_values", "uih_timestamps", "cand_counts", "cand_values",
          "cand_timestamps", "labels")


def ratings_log(path, users=23, seed=0):
    rng = np.random.default_rng(seed)
    lines = []
    for u in range(users):
        for _ in range(int(rng.integers(2, 40))):
            lines.append(f"u{u},i{rng.integers(0, 60)},{rng.integers(1, 6)},{rng.integers(0, 10_000)}")
    rng.shuffle(lines)
    path.write_text("\n".join(lines) + "\n")
    return read_ratings(str(path))


def write_prepared(folder, sources, labels, task, *, rows_per_group=7, rows_per_file=20, max_uih_len=5):
    """The sources' samples (retrieval: the next item only) as a prepared dataset."""
    with DatasetWriter(str(folder)) as out:
        for split, src in sources.items():
            positions = np.arange(src.num_samples)
            samples = src.samples_at(positions)
            seen = src.seen_items(positions) if (task == "retrieval" and split == "eval") else None
            writer = out.split(split, sample_schema(labels, [], seen is not None), rows_per_group=rows_per_group,
                               rows_per_file=rows_per_file)
            writer.write(samples_table(samples, labels, seen_items=seen))
        return out.commit(Manifest(task=task, num_items=src.num_items, num_users=23, min_uih_len=1,
                                   max_uih_len=max_uih_len, num_candidates=2, labels=labels))


def assert_same(got, want):
    for name in FIELDS:
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)


@pytest.fixture
def ranking(tmp_path):
    log = ratings_log(tmp_path / "log.csv")
    kw = dict(min_uih_len=1, max_uih_len=5, num_candidates=2, positive_rating=4, more_labels=(5,), holdout_fraction=0.2)
    sources = {s: RatingsSource(log, split=s, **kw) for s in ("train", "eval")}
    folder = write_prepared(tmp_path / "prepared", sources, ["rating>=4", "rating>=5"], "ranking")
    return sources, folder


def test_ranking_samples_are_the_ratings_readers_at_any_positions(ranking):
    sources, folder = ranking
    for split, want in sources.items():
        got = ParquetSource(folder, split, cache_row_groups=2)
        assert got.num_samples == want.num_samples and got.num_items == want.num_items
        assert len(got._declared) > 1 or split == "eval"  # several files for the train split
        positions = np.random.default_rng(1).permutation(want.num_samples)[: want.num_samples // 2]
        assert_same(got.samples_at(positions), want.samples_at(positions))
        assert_same(got.samples_at(np.arange(want.num_samples)), want.samples_at(np.arange(want.num_samples)))
        assert len(got._cache) <= 2  # memory: a bounded number of decoded row groups


def test_a_position_maps_to_its_file_and_row(ranking):
    _, folder = ranking
    src = ParquetSource(folder, "train")
    for position in (0, 6, 7, 19, 20, 27, src.num_samples - 1):
        path, group, row = src.locate(position)
        table = pq.ParquetFile(path).read_row_group(group, columns=["sample_id"])
        assert table.column("sample_id")[row].as_py() == position  # train ids are the positions


@pytest.mark.parametrize("stride", [0, 2])
def test_retrieval_negatives_and_seen_items_are_the_ratings_readers(tmp_path, stride):
    log = ratings_log(tmp_path / "log.csv", seed=3)
    kw = dict(min_uih_len=1, max_uih_len=5, num_candidates=1, positive_rating=4, holdout_fraction=0.1,
              task="retrieval", seed=11, window_stride=stride)
    stored = {s: RatingsSource(log, split=s, num_negatives=0, **kw) for s in ("train", "eval")}
    folder = write_prepared(tmp_path / "prepared", stored, ["next_item"], "retrieval")
    for split in ("train", "eval"):
        want = RatingsSource(log, split=split, num_negatives=6, **kw)
        got = ParquetSource(folder, split, task="retrieval", num_negatives=6, seed=11)
        positions = np.random.default_rng(2).permutation(want.num_samples)
        assert_same(got.samples_at(positions), want.samples_at(positions))
        if split == "eval":
            for a, b in zip(got.seen_items(positions), want.seen_items(positions)):
                np.testing.assert_array_equal(a, b)
    other_seed = ParquetSource(folder, "train", task="retrieval", num_negatives=6, seed=12).samples_at(np.arange(5))
    assert not np.array_equal(other_seed.cand_values, RatingsSource(log, split="train", num_negatives=6, **kw)
                              .samples_at(np.arange(5)).cand_values)


def rewrite(path, table):
    pq.write_table(table, path, row_group_size=table.num_rows)


def one_line(excinfo, *words):
    message = str(excinfo.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_bad_files_name_the_file(ranking):
    _, folder = ranking
    first = os.path.join(folder, "eval", "part-00000.parquet")
    original = pq.read_table(first)

    rewrite(first, original.drop_columns(["cand_times"]))
    with pytest.raises(SampleFileError) as e:
        ParquetSource(folder, "eval").samples_at(np.arange(3))
    one_line(e, first, "cand_times")

    rewrite(first, original.set_column(original.schema.get_field_index("user_id"), "user_id",
                                       pa.array([str(x) for x in original.column("user_id").to_pylist()])))
    with pytest.raises(SampleFileError) as e:
        ParquetSource(folder, "eval").samples_at(np.arange(3))
    one_line(e, first, "user_id", "string")

    with open(first, "wb") as f:
        f.write(b"PAR1 not really")
    with pytest.raises(SampleFileError) as e:
        ParquetSource(folder, "eval").samples_at(np.arange(3))
    one_line(e, first, "not a readable Parquet file")

    os.remove(first)
    with pytest.raises(SampleFileError) as e:
        ParquetSource(folder, "eval").samples_at(np.arange(3))
    one_line(e, first, "missing")


def test_rows_beyond_the_manifest_are_refused(ranking):
    _, folder = ranking
    first = os.path.join(folder, "train", "part-00000.parquet")
    original = pq.read_table(first)
    manifest = Manifest.load(folder)
    # A history longer than the manifest's maximum.
    long = original.column("uih_items").to_pylist()
    long[0] = list(range(manifest.max_uih_len + 1))
    times = original.column("uih_times").to_pylist()
    times[0] = list(range(manifest.max_uih_len + 1))
    t = original.set_column(original.schema.get_field_index("uih_items"), "uih_items", pa.array(long, pa.list_(pa.int64())))
    t = t.set_column(t.schema.get_field_index("uih_times"), "uih_times", pa.array(times, pa.list_(pa.int64())))
    pq.write_table(t, first, row_group_size=7)
    with pytest.raises(SampleFileError) as e:
        ParquetSource(folder, "train").samples_at(np.arange(3))
    one_line(e, first, "row group 0", "max_uih_len")
    # An item id beyond the vocabulary.
    cands = original.column("cand_items").to_pylist()
    cands[1] = [manifest.num_items] * len(cands[1])
    t = original.set_column(original.schema.get_field_index("cand_items"), "cand_items", pa.array(cands, pa.list_(pa.int64())))
    pq.write_table(t, first, row_group_size=7)
    with pytest.raises(SampleFileError) as e:
        ParquetSource(folder, "train").samples_at(np.arange(3))
    one_line(e, first, "cand_items", str(manifest.num_items))
    # Row groups other than the manifest's.
    pq.write_table(original, first, row_group_size=5)
    with pytest.raises(SampleFileError) as e:
        ParquetSource(folder, "train").samples_at(np.arange(3))
    one_line(e, first, "row groups")


def test_a_manifest_that_does_not_add_up_is_refused(ranking):
    import json

    _, folder = ranking
    path = os.path.join(folder, "manifest.json")
    raw = json.load(open(path))
    raw["splits"]["train"]["rows"] += 1
    json.dump(raw, open(path, "w"))
    with pytest.raises(SampleFileError) as e:
        ParquetSource(folder, "train")
    one_line(e, path, "train")


def test_the_run_must_agree_with_the_prepared_set(ranking):
    _, folder = ranking
    with pytest.raises(SampleFileError) as e:
        ParquetSource(folder, "train", task="retrieval")
    one_line(e, "ranking", "retrieval")
    with pytest.raises(SampleFileError) as e:
        ParquetSource(folder, "train", max_uih_len=3)
    one_line(e, "max_uih_len", "5")


def test_a_failed_write_leaves_the_previous_dataset(ranking, tmp_path):
    _, folder = ranking
    before = sorted(os.listdir(folder))
    with pytest.raises(RuntimeError):
        with DatasetWriter(folder) as out:
            out.split("train", sample_schema(["x"], [], False)).write(
                samples_table(ParquetSource(folder, "train").samples_at(np.arange(3)), ["x"]))
            raise RuntimeError("interrupted")
    assert sorted(os.listdir(folder)) == before
    assert [p for p in os.listdir(os.path.dirname(folder)) if ".tmp-" in p] == []
    ParquetSource(folder, "train").samples_at(np.arange(3))
