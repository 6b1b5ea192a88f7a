"""Samples and Batch: the jagged fields, event times and 2-D labels travel together."""

import dataclasses

import numpy as np
import pytest
import torch

import freescale.data.batch as batch_module
from freescale.config import DataConfig, RatingsDataConfig, SyntheticDataConfig
from freescale.data.batch import HOST_FIELDS, SPARSE_FIELDS, Batch, Samples, SideLayout
from freescale.data.sample_files import SideFeature
from freescale.data.features import label_names


def samples(first_id=0):
    """Three samples; every time and label encodes its own position, so a mix-up shows."""
    uih_lengths = np.array([2, 0, 3])
    cand_counts = np.array([1, 2, 2])
    return Samples(
        sample_ids=first_id + np.arange(3), user_ids=np.array([7, 8, 9]), uih_lengths=uih_lengths,
        uih_values=np.array([10, 11, 30, 31, 32]), uih_timestamps=np.array([100, 101, 300, 301, 302]),
        cand_counts=cand_counts, cand_values=np.array([12, 20, 21, 33, 34]),
        cand_timestamps=np.array([102, 200, 200, 303, 303]),
        labels=np.array([[1, 0], [0, 0], [1, 1], [0, 1], [1, 0]], dtype=np.float32),
    )


def test_select_and_concat_carry_times_and_label_rows():
    s = samples()
    picked = s.select(np.array([2, 0]))
    np.testing.assert_array_equal(picked.uih_timestamps, [300, 301, 302, 100, 101])
    np.testing.assert_array_equal(picked.cand_timestamps, [303, 303, 102])
    np.testing.assert_array_equal(picked.labels, [[0, 1], [1, 0], [1, 0]])
    both = Samples.concat([picked, samples(10).select(np.array([1]))])
    np.testing.assert_array_equal(both.cand_timestamps, [303, 303, 102, 200, 200])
    np.testing.assert_array_equal(both.labels, [[0, 1], [1, 0], [1, 0], [0, 0], [1, 1]])
    assert both.uih_timestamps.shape == (5,) and both.labels.dtype == np.float32
    # An empty selection keeps the labels 2-D.
    assert s.select(np.array([], dtype=np.int64)).labels.shape == (0, 2)


def test_batch_keeps_times_on_the_host_and_labels_2d(monkeypatch):
    s = samples()
    b = Batch.from_samples(s, batch_index=3, user_hash_size=5)
    np.testing.assert_array_equal(b.uih_timestamps.numpy(), s.uih_timestamps)
    np.testing.assert_array_equal(b.cand_timestamps.numpy(), s.cand_timestamps)
    assert b.uih_timestamps.dtype == b.cand_timestamps.dtype == torch.int64
    assert b.labels.shape == (5, 2) and b.labels.dtype == torch.float32
    assert {"uih_timestamps", "cand_timestamps"} <= set(HOST_FIELDS)
    # The meta device stands in for an accelerator (pinning would need a real one).
    monkeypatch.setattr(batch_module, "to_device", lambda tensor, device: tensor.to(device))
    moved = b.to(torch.device("meta"))
    assert moved.labels.device.type == "meta"
    assert moved.uih_timestamps.device.type == moved.cand_timestamps.device.type == "cpu"
    np.testing.assert_array_equal(moved.cand_timestamps.numpy(), s.cand_timestamps)


def test_label_names():
    assert label_names(DataConfig()) == ["click"]
    assert label_names(DataConfig(synthetic=SyntheticDataConfig(num_labels=2))) == ["click", "liked"]
    ratings = DataConfig(source="ratings", ratings=RatingsDataConfig(positive_rating=4, more_labels=[5, 4.5]))
    assert label_names(ratings) == ["rating>=4", "rating>=5", "rating>=4.5"]
    assert label_names(ratings, "retrieval") == ["next_item"]


def test_per_user_groups_are_the_source_user_ids_not_their_hashes():
    """Users 7 and 12 share a row of a 5-row user table; GAUC's groups keep them apart."""
    s = samples()
    s.user_ids = np.array([7, 12, 9])
    b = Batch.from_samples(s, batch_index=0, user_hash_size=5)
    assert b.user_features.values().tolist() == [2, 2, 4]
    assert b.candidate_users().tolist() == [7, 12, 12, 9, 9]
    assert "user_ids" in HOST_FIELDS


LAYOUT = SideLayout(user=(SideFeature("age", 10, 1), SideFeature("tags", 50, 2)), item=(SideFeature("genre", 40, 3),))


def with_side(s):
    """``samples()`` with side features: a user's slots hold 10 * its row + slot, an event's 100 + ...,
    a candidate's 200 + ... (within each feature's values), some slots unused."""
    return dataclasses.replace(
        s, side_layout=LAYOUT,
        user_side=np.array([[7, 20, 21], [8, -1, -1], [9, 40, -1]]),
        uih_side=np.array([[0, 1, 2], [3, -1, -1], [6, 7, -1], [9, 10, 11], [-1, -1, -1]]),
        cand_side=np.array([[20, -1, -1], [23, 24, 25], [26, -1, -1], [29, 30, -1], [32, 33, 34]]))


def test_select_and_concat_carry_the_side_features_of_each_row():
    s = with_side(samples())
    picked = s.select(np.array([2, 0]))
    np.testing.assert_array_equal(picked.user_side, [[9, 40, -1], [7, 20, 21]])
    np.testing.assert_array_equal(picked.uih_side, [[6, 7, -1], [9, 10, 11], [-1, -1, -1], [0, 1, 2], [3, -1, -1]])
    np.testing.assert_array_equal(picked.cand_side, [[29, 30, -1], [32, 33, 34], [20, -1, -1]])
    assert picked.side_layout == LAYOUT
    both = Samples.concat([picked, s.select(np.array([1]))])
    np.testing.assert_array_equal(both.user_side, [[9, 40, -1], [7, 20, 21], [8, -1, -1]])
    np.testing.assert_array_equal(both.cand_side[3:], [[23, 24, 25], [26, -1, -1]])
    assert both.uih_side.shape == (5, 3) and both.side_layout == LAYOUT
    empty = s.select(np.array([], dtype=np.int64))
    assert empty.user_side.shape == (0, 3) and empty.cand_side.shape == (0, 3)
    # Without side features every row has none: empty-width arrays of the right row counts.
    plain = samples()
    assert plain.user_side.shape == (3, 0) and plain.uih_side.shape == (5, 0) and plain.cand_side.shape == (5, 0)
    with pytest.raises(ValueError, match="different side features"):
        Samples.concat([plain, s])
    with pytest.raises(ValueError, match=r"Samples.cand_side: expected \[5, 3\]"):
        dataclasses.replace(s, cand_side=s.cand_side[:, :2])


def _bags(prefix, features, slots):
    """The straightforward construction: for each feature, each row's used slots, in order."""
    out, at = {}, 0
    for f in features:
        out[prefix + f.name] = [[int(v) for v in row[at:at + f.max_values] if v != -1] for row in slots]
        at += f.max_values
    return out


def _as_bags(kjt):
    return {key: [jt.tolist() for jt in kjt[key].to_dense()] for key in kjt.keys()}


def test_the_side_feature_kjts_hold_each_row_s_values_without_padding():
    s = with_side(samples())
    b = Batch.from_samples(s, batch_index=0, user_hash_size=5)
    assert b.user_side_features.keys() == ["user:age", "user:tags"] and b.user_side_features.stride() == 3
    assert _as_bags(b.user_side_features) == _bags("user:", LAYOUT.user, s.user_side)
    # Item features: a bag per history event, then a bag per candidate.
    assert b.item_side_features.keys() == ["item:genre"] and b.item_side_features.stride() == 10
    assert _as_bags(b.item_side_features) == _bags("item:", LAYOUT.item, np.concatenate([s.uih_side, s.cand_side]))
    assert b.item_side_features.lengths().tolist() == [3, 1, 2, 3, 0, 1, 3, 1, 2, 3]
    assert {"user_side_features", "item_side_features"} <= set(SPARSE_FIELDS)
    # None: empty KJTs of the right stride.
    plain = Batch.from_samples(samples(), batch_index=0, user_hash_size=5)
    assert plain.user_side_features.keys() == [] and plain.user_side_features.stride() == 3
    assert plain.item_side_features.stride() == 10


def test_a_side_value_outside_its_feature_is_refused_naming_it():
    s = with_side(samples())
    s.cand_side[1, 2] = 40  # item:genre has 40 values
    with pytest.raises(ValueError, match=r"side feature item:genre: value 40 is outside its 40 values \(0..39"):
        Batch.from_samples(s, batch_index=0, user_hash_size=5)
    s = with_side(samples())
    s.user_side[0, 0] = -2
    with pytest.raises(ValueError, match="side feature user:age: value -2"):
        Batch.from_samples(s, batch_index=0, user_hash_size=5)
