"""The samples of a prepared dataset (``freescale.data.sample_files``), read by row group.

``ParquetSource(folder, split, ...)`` is a finite ``SampleSource``: stream position ``p`` is row
``p`` of the split, counted across its files in the manifest's order (the files hold the samples
in time order), so the loader's cursor (the global batch index) maps to a (file, row group, row)
by a binary search over the row groups' first rows. A rank asks only for the positions of its own
slice of each global batch and reads only the row groups that hold them; decoded row groups are
kept in a small LRU cache (``cache_row_groups``), so memory is bounded by a few row groups
whatever the dataset's size. Only the columns the run uses are read.

Retrieval files store each sample's next item only (label 1); its ``num_negatives`` uniform
negatives are drawn here from the run's seed and the sample id (``freescale.data.retrieval``),
exactly as a ratings log's source draws them.

Everything is checked against the manifest: every file's footer when the source is made (its
columns and their types, its row groups), so before a run writes anything, and each row group
when it is decoded (history lengths within the declared maximum, ids within the vocabularies,
no nulls); a problem raises ``SampleFileError`` naming the file (and row group or column).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

import numpy as np

from freescale.data.batch import PADDING, Samples, SideLayout
from freescale.data.retrieval import next_item_candidates
from freescale.data.sample_files import (ITEM_PREFIX, ITEMS_FILE, LABEL_PREFIX, USER_PREFIX, Manifest, SampleFileError,
                                         sample_schema)

CACHE_ROW_GROUPS = 4
"""Decoded row groups a source keeps by default."""


class ParquetSource:
    """The ``split`` ("train" or "eval") of the prepared dataset in ``folder``."""

    def __init__(self, folder: str, split: str, *, task: str = "ranking", num_negatives: int = 0, seed: int = 0,
                 max_uih_len: int | None = None, cache_row_groups: int = CACHE_ROW_GROUPS) -> None:
        self.folder = folder
        self.manifest = Manifest.load(folder)
        m = self.manifest
        if split not in m.splits:
            raise SampleFileError(f"{folder}: no {split} split in the manifest")
        if task != m.task:
            raise SampleFileError(f"{folder}: prepared for task {m.task}, the run's task.kind is {task}")
        if max_uih_len is not None and max_uih_len < m.max_uih_len:
            raise SampleFileError(f"{folder}: histories are up to {m.max_uih_len} events, above data.max_uih_len "
                                  f"{max_uih_len}; raise it or prepare again with that maximum")
        entry = m.splits[split]
        if int(entry["rows"]) == 0:
            raise SampleFileError(f"{folder}: the {split} split is empty")
        self.split = split
        self.task = task
        self.num_negatives = num_negatives
        self.seed = seed
        self.num_items = m.num_items
        self.labels = list(m.labels)
        self._files = [os.path.join(folder, f["path"]) for f in entry["files"]]
        self._declared = entry["files"]
        # Row groups in stream order: (file index, group within the file), and the first row of each.
        groups, sizes = [], []
        for i, f in enumerate(entry["files"]):
            if int(f["rows"]) == 0 or not f.get("row_groups"):
                raise SampleFileError(f"{self._files[i]}: an empty file in the {split} split")
            for g, rows in enumerate(f["row_groups"]):
                groups.append((i, g))
                sizes.append(int(rows))
        self._groups = groups
        self._group_start = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._columns = ["sample_id", "user_id", "uih_items", "uih_times", "cand_items", "cand_times",
                         *(LABEL_PREFIX + name for name in self.labels)]
        self.side_layout = SideLayout(user=tuple(m.user_features), item=tuple(m.item_features))
        self._columns += [USER_PREFIX + f.name for f in m.user_features]
        self._with_seen = split == "eval" and task == "retrieval"
        if self._with_seen:
            self._columns.append("seen_items")
        self._expected = sample_schema(self.labels, [f.name for f in m.user_features], self._with_seen)
        self._items = self._item_table() if m.item_features else np.zeros((m.num_items, 0), dtype=np.int64)
        self._cache: OrderedDict[int, tuple[Samples, list[np.ndarray] | None]] = OrderedDict()
        self._capacity = max(1, cache_row_groups)
        self._opened: dict[int, object] = {}
        self._lock = threading.Lock()
        for i in range(len(self._files)):  # every footer against the manifest, before a run writes anything
            self._open(i)

    @property
    def num_samples(self) -> int:
        return int(self._group_start[-1])

    def item_side(self, item_ids: np.ndarray) -> np.ndarray:
        """int64 [len(item_ids), side_layout.item_width]: the items' side features (padding -1)."""
        return self._items[np.asarray(item_ids, dtype=np.int64)]

    def _item_table(self) -> np.ndarray:
        """``items.parquet`` as a dense [num_items, item_width] array (an item it lacks: padding)."""
        import pyarrow.parquet as pq

        path = os.path.join(self.folder, ITEMS_FILE)
        if not os.path.isfile(path):
            raise SampleFileError(f"{path}: the manifest declares item features but the file is missing")
        try:
            table = pq.read_table(path)
        except Exception as e:
            raise SampleFileError(f"{path}: not a readable Parquet file ({_one_line(e)})") from None
        ids = _plain_column(table, "item_id", path)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.num_items):
            raise SampleFileError(f"{path}: column 'item_id' has ids outside the manifest's {self.num_items} items")
        out = np.full((self.num_items, self.side_layout.item_width), PADDING, dtype=np.int64)
        out[ids] = _slots(table, [(ITEM_PREFIX + f.name, f) for f in self.side_layout.item], path)
        return out

    def locate(self, position: int) -> tuple[str, int, int]:
        """(file, row group in the file, row in the group) of stream ``position``."""
        g = int(np.searchsorted(self._group_start, position, side="right")) - 1
        file, group = self._groups[g]
        return self._files[file], group, int(position - self._group_start[g])

    def samples_at(self, positions: np.ndarray) -> Samples:
        """Samples at ``positions`` (0 .. num_samples-1) of the split, in the order given."""
        samples, _ = self._rows(positions, seen=False)
        if self.task == "retrieval":
            samples = self._with_negatives(samples)
        return samples

    def seen_items(self, positions: np.ndarray) -> list[np.ndarray] | None:
        """Held-out retrieval: each sample's user's every item before its candidate (None for
        the other splits: their samples' histories are all the files hold)."""
        return self._rows(positions, seen=True)[1] if self._with_seen else None

    # Reading ---------------------------------------------------------------------------------

    def _rows(self, positions: np.ndarray, *, seen: bool):
        p = np.asarray(positions, dtype=np.int64)
        if len(p) and (p.min() < 0 or p.max() >= self.num_samples):
            raise IndexError(f"positions outside 0..{self.num_samples - 1}")
        group = np.searchsorted(self._group_start, p, side="right") - 1
        order = np.argsort(group, kind="stable")
        parts, seen_parts = [], []
        for g in np.unique(group):
            rows = p[order][group[order] == g] - self._group_start[g]
            samples, seen_items = self._group(int(g))
            parts.append(samples.select(rows))
            if seen:
                seen_parts += [seen_items[r] for r in rows.tolist()]
        if not parts:
            return self._group(0)[0].select(p), []
        grouped = parts[0] if len(parts) == 1 else Samples.concat(parts)
        back = np.argsort(order, kind="stable")
        return grouped.select(back), ([seen_parts[i] for i in back.tolist()] if seen else None)

    def _group(self, g: int):
        with self._lock:
            hit = self._cache.get(g)
            if hit is not None:
                self._cache.move_to_end(g)
                return hit
            decoded = self._decode(g)
            self._cache[g] = decoded
            while len(self._cache) > self._capacity:
                self._cache.popitem(last=False)
            return decoded

    def _open(self, i: int):
        import pyarrow.parquet as pq

        if i in self._opened:
            return self._opened[i]
        path = self._files[i]
        try:
            f = pq.ParquetFile(path)
        except FileNotFoundError:
            raise SampleFileError(f"{path}: listed in the manifest but missing") from None
        except Exception as e:  # pyarrow raises ArrowInvalid/OSError for a corrupt footer
            raise SampleFileError(f"{path}: not a readable Parquet file ({_one_line(e)})") from None
        schema = f.schema_arrow
        for name in self._columns:
            if name not in schema.names:
                raise SampleFileError(f"{path}: no column {name!r}")
            want = self._expected.field(name).type
            if not schema.field(name).type.equals(want):
                raise SampleFileError(f"{path}: column {name!r} is {schema.field(name).type}, expected {want}")
        declared = self._declared[i]
        actual = [f.metadata.row_group(g).num_rows for g in range(f.num_row_groups)]
        if actual != [int(r) for r in declared["row_groups"]]:
            raise SampleFileError(f"{path}: row groups of {actual} rows, the manifest says {declared['row_groups']}")
        self._opened[i] = f
        if len(self._opened) > 8:  # keep a few files open
            self._opened.pop(next(iter(self._opened)))
        return f

    def _decode(self, g: int):
        file, group = self._groups[g]
        path = self._files[file]
        f = self._open(file)
        try:
            table = f.read_row_group(group, columns=self._columns)
        except Exception as e:
            raise SampleFileError(f"{path}: row group {group} is unreadable ({_one_line(e)})") from None
        where = f"{path}: row group {group}"
        uih_len, uih = _list_column(table, "uih_items", where)
        _, uih_times = _list_column(table, "uih_times", where, uih_len)
        cand_len, cand = _list_column(table, "cand_items", where)
        _, cand_times = _list_column(table, "cand_times", where, cand_len)
        labels = np.stack([_list_column(table, LABEL_PREFIX + n, where, cand_len)[1] for n in self.labels], axis=1)
        m = self.manifest
        if len(uih_len) and uih_len.max() > m.max_uih_len:
            raise SampleFileError(f"{where}: a history of {uih_len.max()} events, above the manifest's max_uih_len {m.max_uih_len}")
        for name, ids in (("uih_items", uih), ("cand_items", cand)):
            if len(ids) and (ids.min() < 0 or ids.max() >= m.num_items):
                raise SampleFileError(f"{where}: column {name!r} has item id {ids.max() if ids.max() >= m.num_items else ids.min()} "
                                      f"outside the manifest's {m.num_items} items")
        samples = Samples(
            sample_ids=_plain_column(table, "sample_id", where), user_ids=_plain_column(table, "user_id", where),
            uih_lengths=uih_len, uih_values=uih, uih_timestamps=uih_times,
            cand_counts=cand_len, cand_values=cand, cand_timestamps=cand_times, labels=labels.astype(np.float32),
            user_side=_slots(table, [(USER_PREFIX + f.name, f) for f in self.side_layout.user], where),
            uih_side=self.item_side(uih), cand_side=self.item_side(cand), side_layout=self.side_layout,
        )
        seen = None
        if self._with_seen:
            seen_len, seen_values = _list_column(table, "seen_items", where)
            bounds = np.concatenate([[0], np.cumsum(seen_len)])
            seen = [seen_values[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        return samples, seen

    def _with_negatives(self, s: Samples) -> Samples:
        """Retrieval: the stored next item followed by the sample's negatives."""
        if not np.all(s.cand_counts == 1):
            raise SampleFileError(f"{self.folder}: retrieval samples must hold exactly one candidate (the next item)")
        counts, values, times, labels = next_item_candidates(s.sample_ids, s.cand_values, s.cand_timestamps,
                                                             seed=self.seed, num_negatives=self.num_negatives,
                                                             num_items=self.num_items)
        s.cand_counts, s.cand_values, s.cand_timestamps, s.labels = counts, values, times, labels
        s.cand_side = self.item_side(values)
        return s


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())[:200]


def _plain_column(table, name: str, where: str) -> np.ndarray:
    column = table.column(name)
    if column.null_count:
        raise SampleFileError(f"{where}: column {name!r} has nulls")
    return column.to_numpy().astype(np.int64, copy=False)


def _list_column(table, name: str, where: str, lengths: np.ndarray | None = None):
    """(lengths, flat values) of a list column; ``lengths``: what the rows must have."""
    column = table.column(name).combine_chunks()
    if column.null_count or column.values.null_count:
        raise SampleFileError(f"{where}: column {name!r} has null rows")
    offsets = column.offsets.to_numpy()
    values = column.values.to_numpy(zero_copy_only=False)[offsets[0]:offsets[-1]]
    got = np.diff(offsets).astype(np.int64)
    if lengths is not None and not np.array_equal(got, lengths):
        raise SampleFileError(f"{where}: column {name!r} does not line up with the items it belongs to")
    return got, values.astype(np.int64 if values.dtype.kind in "iu" else np.float32, copy=False)


def _slots(table, columns: list, where: str) -> np.ndarray:
    """int64 [rows, sum of max_values]: the (column, SideFeature) list columns in slot order, each
    row's values then padding; values outside a feature's ``num_values`` are refused."""
    out = np.full((table.num_rows, sum(f.max_values for _, f in columns)), PADDING, dtype=np.int64)
    at = 0
    for name, feature in columns:
        lengths, values = _list_column(table, name, where)
        if len(lengths) and lengths.max() > feature.max_values:
            raise SampleFileError(f"{where}: column {name!r} has a row of {lengths.max()} values, the manifest "
                                  f"says at most {feature.max_values}")
        if len(values) and (values.min() < 0 or values.max() >= feature.num_values):
            raise SampleFileError(f"{where}: column {name!r} has value {values.max() if values.max() >= feature.num_values else values.min()} "
                                  f"outside the manifest's {feature.num_values}")
        row = np.repeat(np.arange(len(lengths)), lengths)
        within = np.arange(len(values)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        out[row, at + within] = values
        at += feature.max_values
    return out
