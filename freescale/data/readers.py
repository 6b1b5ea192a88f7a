"""Readers for ratings-style logs, turned into time-ordered recommendation samples.

Accepted files (detected from the first data line):
- CSV ``user,item,rating,timestamp``, with or without a header line;
- MovieLens ``ratings.dat``: ``user::item::rating::timestamp``;
- MovieLens-100K ``u.data`` or RecBole's ``ml-100k.inter``: tab-separated, same four fields
  (the ``.inter`` header line is skipped like a CSV header).

Each user's events are sorted by time. A sample is one point in a user's timeline: the
candidates are the next ``num_candidates`` events (label: rating >= ``positive_rating``), the
history is the events before them (the most recent ``max_uih_len``). Consecutive samples of a
user do not share candidates, so every event is a candidate at most once. Samples are then
ordered by the time of their first candidate, and the latest ``holdout_fraction`` are held out
for evaluation. A sample's id is its index in that global time order, so ids are stable for a
given file and settings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from freescale.data.batch import Samples


class DataError(ValueError):
    """A data file that cannot be read; the message is one line naming the file."""


@dataclass
class RatingsLog:
    users: np.ndarray  # int64 contiguous user index
    items: np.ndarray  # int64 contiguous item index
    ratings: np.ndarray  # float64
    timestamps: np.ndarray  # float64
    num_users: int
    num_items: int


def read_ratings(path: str) -> RatingsLog:
    """Parse a ratings log; user and item ids of any spelling map to contiguous indices."""
    if not os.path.isfile(path):
        raise DataError(f"ratings file not found: {path}")
    users, items, ratings, stamps = [], [], [], []
    sep = None
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            if sep is None:
                sep = "::" if "::" in line else "\t" if "\t" in line else ","
            fields = [x.strip() for x in line.split(sep)]
            if len(fields) != 4:
                raise DataError(f"{path}:{lineno}: expected 4 fields user{sep}item{sep}rating{sep}timestamp, got {len(fields)}")
            try:
                rating, stamp = float(fields[2]), float(fields[3])
            except ValueError:
                if not users:  # a header line
                    continue
                raise DataError(f"{path}:{lineno}: rating and timestamp must be numbers, got {fields[2]!r}, {fields[3]!r}") from None
            users.append(fields[0])
            items.append(fields[1])
            ratings.append(rating)
            stamps.append(stamp)
    if not users:
        raise DataError(f"{path}: no ratings found")
    user_keys, user_idx = np.unique(np.array(users), return_inverse=True)
    item_keys, item_idx = np.unique(np.array(items), return_inverse=True)
    return RatingsLog(
        users=user_idx.astype(np.int64),
        items=item_idx.astype(np.int64),
        ratings=np.asarray(ratings, dtype=np.float64),
        timestamps=np.asarray(stamps, dtype=np.float64),
        num_users=len(user_keys),
        num_items=len(item_keys),
    )


class RatingsSource:
    """The train or eval samples of a ratings log (finite; a loader wraps it into epochs)."""

    def __init__(self, log: RatingsLog, *, split: str, min_uih_len: int, max_uih_len: int, num_candidates: int,
                 positive_rating: float, holdout_fraction: float) -> None:
        if split not in ("train", "eval"):
            raise ValueError(f"unknown split {split!r}; expected train or eval")
        self.num_items = log.num_items
        # Events grouped by user, time-ordered within a user (file order breaks ties).
        order = np.lexsort((np.arange(len(log.users)), log.timestamps, log.users))
        self._items = log.items[order]
        self._labels = (log.ratings[order] >= positive_rating).astype(np.float32)
        users = log.users[order]
        stamps = log.timestamps[order]
        user_start = np.searchsorted(users, np.arange(log.num_users))
        user_count = np.bincount(users, minlength=log.num_users)

        # Candidate groups: positions min_uih_len, +C, +2C, ... inside each user's timeline.
        groups = np.maximum(0, -(-(user_count - min_uih_len) // num_candidates))
        owner = np.repeat(np.arange(log.num_users), groups)
        k = np.arange(len(owner)) - np.repeat(np.cumsum(groups) - groups, groups)
        pos = min_uih_len + k * num_candidates  # within the user's timeline
        cand_start = user_start[owner] + pos
        cand_count = np.minimum(num_candidates, user_count[owner] - pos)
        uih_len = np.minimum(pos, max_uih_len)

        # Global time order of samples, then the holdout split at the latest fraction.
        by_time = np.lexsort((pos, owner, stamps[cand_start]))
        n_eval = int(round(len(by_time) * holdout_fraction))
        n_train = len(by_time) - n_eval
        chosen = by_time[:n_train] if split == "train" else by_time[n_train:]
        id_base = 0 if split == "train" else n_train
        if len(chosen) == 0:
            raise DataError(f"the ratings log yields no {split} samples (min_uih_len={min_uih_len}, holdout_fraction={holdout_fraction})")
        self._user = owner[chosen]
        self._cand_start = cand_start[chosen]
        self._cand_count = cand_count[chosen].astype(np.int64)
        self._uih_len = uih_len[chosen].astype(np.int64)
        self._ids = id_base + np.arange(len(chosen), dtype=np.int64)

    @property
    def num_samples(self) -> int:
        return len(self._ids)

    def samples_at(self, positions: np.ndarray) -> Samples:
        """Samples at ``positions`` (0 .. num_samples-1) of this split, in the order given."""
        p = np.asarray(positions, dtype=np.int64)
        uih_len, cand_count = self._uih_len[p], self._cand_count[p]
        uih_idx = _ranges(self._cand_start[p] - uih_len, uih_len)
        cand_idx = _ranges(self._cand_start[p], cand_count)
        return Samples(
            sample_ids=self._ids[p],
            user_ids=self._user[p],
            uih_lengths=uih_len,
            uih_values=self._items[uih_idx],
            cand_counts=cand_count,
            cand_values=self._items[cand_idx],
            labels=self._labels[cand_idx],
        )


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s+l)`` for each (s, l)."""
    total = int(lengths.sum())
    within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + within
