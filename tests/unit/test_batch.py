"""Samples and Batch: the jagged fields, event times and 2-D labels travel together."""

import numpy as np
import torch

import freescale.data.batch as batch_module
from freescale.config import DataConfig, RatingsDataConfig, SyntheticDataConfig
from freescale.data.batch import HOST_FIELDS, Batch, Samples
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
