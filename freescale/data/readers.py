"""Readers for ratings-style logs, turned into time-ordered recommendation samples.

Accepted files (detected from the first data line):
- CSV ``user,item,rating,timestamp``, with or without a header line;
- MovieLens ``ratings.dat``: ``user::item::rating::timestamp``;
- MovieLens-100K ``u.data`` or RecBole's ``ml-100k.inter``: tab-separated, same four fields
  (the ``.inter`` header line is skipped like a CSV header).

Each user's events are sorted by time (file order breaks ties). Every event keeps its log time,
rounded to whole seconds, as the timestamp of the history position or candidate it becomes.

Ranking (the default task): a sample is one point in a user's timeline: the candidates are the
next ``num_candidates`` events, the history is the events before them (the most recent
``max_uih_len``). A candidate's label ``k`` is 1 when its rating is at least the ``k``-th
threshold of ``[positive_rating, *more_labels]``. Consecutive samples of a user do not share
candidates, so every event is a candidate at most once. Samples are then ordered by the time of
their first candidate, and the latest ``holdout_fraction`` are held out for evaluation.

Retrieval: leave-one-out per user, as RecBole's ``LS`` split. The eval split holds one sample
per user with at least two events: its candidate is the user's last event, its history the
(latest ``max_uih_len``) events before it. The train split cuts each user's timeline without
its last event into windows of ``max_uih_len + 1`` events, going backward from the end: the
last window's candidate is the second-to-last event, and each window's first event is the
candidate of the window before it (its only shared event), so every event but the user's first
and last is a target exactly once: the next item of a history position, or a candidate. The
earliest window is shorter; it is dropped when it has fewer than ``min_uih_len + 1`` events.
Candidates are the next item (label 1) then ``num_negatives`` uniform negatives
(``freescale.data.retrieval``), all at the next item's time. Samples are ordered by their
candidate's time.

A sample's id is its index in that global time order (eval ids continue after the train ids),
so ids are stable for a given file and settings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from freescale.data.batch import Samples, SideLayout
from freescale.data.errors import DataError
from freescale.data.retrieval import next_item_candidates


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
                 positive_rating: float, holdout_fraction: float, more_labels: tuple[float, ...] = (),
                 task: str = "ranking", num_negatives: int = 0, seed: int = 0, window_stride: int = 0) -> None:
        if split not in ("train", "eval"):
            raise ValueError(f"unknown split {split!r}; expected train or eval")
        if task not in ("ranking", "retrieval"):
            raise ValueError(f"unknown task {task!r}; expected ranking or retrieval")
        self.num_items = log.num_items
        self.task = task
        self.num_negatives = num_negatives
        self.seed = seed
        # Events grouped by user, time-ordered within a user (file order breaks ties).
        order = np.lexsort((np.arange(len(log.users)), log.timestamps, log.users))
        self._items = log.items[order]
        self._times = np.rint(log.timestamps[order]).astype(np.int64)
        thresholds = np.array([positive_rating, *more_labels], dtype=np.float64)
        self._labels = (log.ratings[order][:, None] >= thresholds[None, :]).astype(np.float32)
        users = log.users[order]
        user_start = np.searchsorted(users, np.arange(log.num_users))
        user_count = np.bincount(users, minlength=log.num_users)

        if task == "retrieval":
            stride = window_stride or max_uih_len
            owner, pos, cand_count, uih_len = _leave_one_out(user_count, split, min_uih_len, max_uih_len, stride)
        else:
            owner, pos, cand_count, uih_len = _candidate_groups(user_count, min_uih_len, max_uih_len, num_candidates)
        cand_start = user_start[owner] + pos

        # Global time order of samples (of their first candidate).
        by_time = np.lexsort((pos, owner, self._times[cand_start]))
        if task == "retrieval":
            chosen = by_time
            id_base = 0 if split == "train" else len(_leave_one_out(user_count, "train", min_uih_len, max_uih_len,
                                                                    stride)[0])
        else:  # the holdout split at the latest fraction
            n_eval = int(round(len(by_time) * holdout_fraction))
            n_train = len(by_time) - n_eval
            chosen = by_time[:n_train] if split == "train" else by_time[n_train:]
            id_base = 0 if split == "train" else n_train
        if len(chosen) == 0:
            raise DataError(f"the ratings log yields no {task} {split} samples (min_uih_len={min_uih_len}, "
                            f"holdout_fraction={holdout_fraction})")
        self._user = owner[chosen]
        self._user_start = user_start[owner[chosen]]
        self._cand_start = cand_start[chosen]
        self._cand_count = cand_count[chosen].astype(np.int64)
        self._uih_len = uih_len[chosen].astype(np.int64)
        self._ids = id_base + np.arange(len(chosen), dtype=np.int64)

    @property
    def num_samples(self) -> int:
        return len(self._ids)

    side_layout = SideLayout()
    """A ratings log has no side features."""

    def item_side(self, item_ids: np.ndarray) -> np.ndarray:
        return np.zeros((len(item_ids), 0), dtype=np.int64)

    def seen_items(self, positions: np.ndarray) -> list[np.ndarray]:
        """Each sample's user's every item before the sample's first candidate (its history
        holds only the latest ``max_uih_len`` of them): what held-out retrieval leaves out."""
        p = np.asarray(positions, dtype=np.int64)
        return [self._items[a:b] for a, b in zip(self._user_start[p].tolist(), self._cand_start[p].tolist())]

    def samples_at(self, positions: np.ndarray) -> Samples:
        """Samples at ``positions`` (0 .. num_samples-1) of this split, in the order given."""
        p = np.asarray(positions, dtype=np.int64)
        uih_len, cand_count = self._uih_len[p], self._cand_count[p]
        uih_idx = _ranges(self._cand_start[p] - uih_len, uih_len)
        ids = self._ids[p]
        if self.task == "retrieval":
            nxt = self._cand_start[p]
            cand_count, cand_values, cand_times, labels = next_item_candidates(
                ids, self._items[nxt], self._times[nxt], seed=self.seed, num_negatives=self.num_negatives,
                num_items=self.num_items)
        else:
            cand_idx = _ranges(self._cand_start[p], cand_count)
            cand_values, cand_times, labels = self._items[cand_idx], self._times[cand_idx], self._labels[cand_idx]
        return Samples(
            sample_ids=ids,
            user_ids=self._user[p],
            uih_lengths=uih_len,
            uih_values=self._items[uih_idx],
            uih_timestamps=self._times[uih_idx],
            cand_counts=cand_count,
            cand_values=cand_values,
            cand_timestamps=cand_times,
            labels=labels,
        )


def _candidate_groups(user_count: np.ndarray, min_uih_len: int, max_uih_len: int, num_candidates: int):
    """Ranking samples as (user, position of the first candidate in the user's timeline,
    candidates, history length): candidate groups at positions min_uih_len, +C, +2C, ..."""
    groups = np.maximum(0, -(-(user_count - min_uih_len) // num_candidates))
    owner = np.repeat(np.arange(len(user_count)), groups)
    k = np.arange(len(owner)) - np.repeat(np.cumsum(groups) - groups, groups)
    pos = min_uih_len + k * num_candidates
    return owner, pos, np.minimum(num_candidates, user_count[owner] - pos), np.minimum(pos, max_uih_len)


def _leave_one_out(user_count: np.ndarray, split: str, min_uih_len: int, max_uih_len: int, stride: int):
    """Retrieval samples, in the same form as ``_candidate_groups`` (one candidate each); training
    windows end ``stride`` events apart (``max_uih_len``: each event a target once)."""
    users = np.arange(len(user_count))
    if split == "eval":
        owner = users[user_count >= 2]
        pos = user_count[owner] - 1
        return owner, pos, np.ones(len(owner), dtype=np.int64), np.minimum(pos, max_uih_len)
    # Windows end at the second-to-last event and step back by max_uih_len (each window's first
    # event is the previous window's candidate); window k from the end has its candidate at
    # ``count - 2 - k * max_uih_len``, and a window needs min_uih_len events before it.
    last = user_count - 2
    windows = np.where(last >= min_uih_len, (last - min_uih_len) // stride + 1, 0)
    owner = np.repeat(users, windows)
    k = np.arange(len(owner)) - np.repeat(np.cumsum(windows) - windows, windows)
    pos = last[owner] - k * stride
    return owner, pos, np.ones(len(owner), dtype=np.int64), np.minimum(pos, max_uih_len)


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s+l)`` for each (s, l)."""
    total = int(lengths.sum())
    within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + within
