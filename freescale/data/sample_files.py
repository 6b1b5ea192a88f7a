"""The sample file format: Parquet files of one row per sample, and the manifest that lists them.

A prepared dataset is a folder (``docs/data.md`` is the full schema)::

    manifest.json              what is in the folder (below); written last
    train/part-00000.parquet   the training samples in time order, files of bounded size
    eval/part-00000.parquet    the held-out samples
    items.parquet              optional: the item side features, one row per item index

A sample row holds ``sample_id`` and ``user_id`` (int64), the history as list columns
``uih_items``, ``uih_times`` (int64 seconds) and ``uih_actions`` (float32: the rating or action
of each event), the candidates as ``cand_items`` and ``cand_times`` with one float32 list column
per label (``label:<name>``, aligned with the candidates), one int64 list column per user side
feature (``user:<name>``) and, for held-out retrieval samples, ``seen_items``: every item of the
user before the candidate (what the full ranking leaves out). ``items.parquet`` holds
``item_id`` and one int64 list column per item side feature (``item:<name>``); item features are
a function of the item, and retrieval's negatives are drawn when the samples are read, so they
are looked up there rather than copied into every row.

The manifest (``MANIFEST``) records the task and the settings the samples were cut with, the
vocabulary sizes, the labels and side features, every file's row count and row-group sizes, and
the history-length histogram of each split. Readers trust only what it says and check the files
against it.

``DatasetWriter`` writes a dataset into a temporary folder next to its destination and renames
it into place when every file is closed, so a folder with a manifest is always complete.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field

import numpy as np

from freescale.data.errors import DataError

MANIFEST = "manifest.json"
FORMAT = "freescale.samples"
VERSION = 1
SPLITS = ("train", "eval")
ITEMS_FILE = "items.parquet"
LABEL_PREFIX = "label:"
USER_PREFIX = "user:"
ITEM_PREFIX = "item:"
HISTOGRAM_EDGES = [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
"""History-length histogram bins: ``[edges[i], edges[i+1])``, the last one open."""
ROWS_PER_GROUP = 4096
"""Default rows per Parquet row group: the unit a reader decodes (and holds a few of)."""
ROWS_PER_FILE = 1 << 20
"""Default rows per file."""


class SampleFileError(DataError):
    """A prepared dataset that cannot be read or written; one line naming the file."""


@dataclass
class SideFeature:
    name: str
    num_values: int
    """Values are 0 .. num_values-1 (the size of the feature's embedding table)."""
    max_values: int
    """The most values one row (a user's or an item's) has: 1 for a single-valued feature."""


@dataclass
class Manifest:
    task: str
    """ranking or retrieval."""
    num_items: int
    num_users: int
    min_uih_len: int
    max_uih_len: int
    num_candidates: int
    labels: list[str]
    splits: dict = field(default_factory=dict)
    """split -> {"rows": N, "files": [{"path", "rows", "row_groups": [rows, ...], "bytes"}]}."""
    histogram: dict = field(default_factory=dict)
    """split -> history-length counts over ``HISTOGRAM_EDGES``."""
    user_features: list[SideFeature] = field(default_factory=list)
    item_features: list[SideFeature] = field(default_factory=list)
    window_stride: int = 0
    holdout_fraction: float = 0.0
    source: dict = field(default_factory=dict)
    """What the samples were made from and with which settings (``prepare``'s idempotence key)."""

    def to_json(self) -> dict:
        out = dict(self.__dict__, format=FORMAT, version=VERSION)
        out["user_features"] = [f.__dict__ for f in self.user_features]
        out["item_features"] = [f.__dict__ for f in self.item_features]
        return out

    @staticmethod
    def load(folder: str) -> "Manifest":
        path = os.path.join(folder, MANIFEST)
        if not os.path.isfile(path):
            raise SampleFileError(f"{path}: no manifest (not a prepared dataset; make one with `freescale prepare`)")
        try:
            with open(path) as f:
                raw = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise SampleFileError(f"{path}: unreadable manifest ({e})") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise SampleFileError(f"{path}: not a {FORMAT} manifest")
        if raw.get("version") != VERSION:
            raise SampleFileError(f"{path}: format version {raw.get('version')}, this reader reads {VERSION}")
        try:
            raw = {k: v for k, v in raw.items() if k not in ("format", "version")}
            raw["user_features"] = [SideFeature(**f) for f in raw.get("user_features", [])]
            raw["item_features"] = [SideFeature(**f) for f in raw.get("item_features", [])]
            manifest = Manifest(**raw)
        except TypeError as e:
            raise SampleFileError(f"{path}: malformed manifest ({e})") from None
        for split in SPLITS:
            entry = manifest.splits.get(split)
            if not entry or not isinstance(entry.get("files"), list):
                raise SampleFileError(f"{path}: no {split} split")
            if sum(int(f["rows"]) for f in entry["files"]) != int(entry["rows"]):
                raise SampleFileError(f"{path}: the {split} files' row counts do not add up to its {entry['rows']} rows")
        return manifest


def histogram(lengths: np.ndarray) -> np.ndarray:
    """Counts of ``lengths`` over ``HISTOGRAM_EDGES``."""
    bins = np.searchsorted(np.asarray(HISTOGRAM_EDGES), np.asarray(lengths), side="right") - 1
    return np.bincount(bins, minlength=len(HISTOGRAM_EDGES))[: len(HISTOGRAM_EDGES)]


def sample_schema(labels: list[str], user_features: list[str], seen_items: bool):
    """The pyarrow schema of a sample file."""
    import pyarrow as pa

    ints, floats = pa.list_(pa.int64()), pa.list_(pa.float32())
    fields = [("sample_id", pa.int64()), ("user_id", pa.int64()), ("uih_items", ints), ("uih_times", ints),
              ("uih_actions", floats), ("cand_items", ints), ("cand_times", ints)]
    fields += [(LABEL_PREFIX + name, floats) for name in labels]
    fields += [(USER_PREFIX + name, ints) for name in user_features]
    if seen_items:
        fields.append(("seen_items", ints))
    return pa.schema(fields)


class SplitWriter:
    """Rows of one split into ``<folder>/<split>/part-NNNNN.parquet``, rolling over every
    ``rows_per_file`` rows, in row groups of ``rows_per_group``; tallies the manifest's entry."""

    def __init__(self, folder: str, split: str, schema, *, rows_per_file: int = ROWS_PER_FILE,
                 rows_per_group: int = ROWS_PER_GROUP) -> None:
        self.folder = folder
        self.split = split
        self.schema = schema
        self.rows_per_file = max(1, rows_per_file)
        self.rows_per_group = max(1, min(rows_per_group, self.rows_per_file))
        os.makedirs(os.path.join(folder, split), exist_ok=True)
        self.files: list[dict] = []
        self.counts = np.zeros(len(HISTOGRAM_EDGES), dtype=np.int64)
        self._writer = None
        self._pending: list = []  # tables not yet a whole row group
        self._pending_rows = 0

    def write(self, table) -> None:
        """Append rows (a pyarrow Table or RecordBatch with this split's schema), in order."""
        import pyarrow as pa

        if isinstance(table, pa.RecordBatch):
            table = pa.Table.from_batches([table])
        table = table.select(self.schema.names).cast(self.schema)
        lengths = table.column("uih_items").combine_chunks().value_lengths().to_numpy(zero_copy_only=False)
        self.counts += histogram(lengths)
        self._pending.append(table)
        self._pending_rows += table.num_rows
        while self._pending_rows >= self.rows_per_group:
            self._flush(self.rows_per_group)

    def _flush(self, rows: int) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pending = pa.concat_tables(self._pending)
        if self._writer is None or self.files[-1]["rows"] >= self.rows_per_file:
            self._close_file()
            path = os.path.join(self.split, f"part-{len(self.files):05d}.parquet")
            self.files.append({"path": path, "rows": 0, "row_groups": []})
            self._writer = pq.ParquetWriter(os.path.join(self.folder, path), self.schema, compression="zstd")
        rows = min(rows, self.rows_per_file - self.files[-1]["rows"])
        self._writer.write_table(pending.slice(0, rows), row_group_size=rows)
        self.files[-1]["rows"] += rows
        self.files[-1]["row_groups"].append(rows)
        rest = pending.slice(rows)
        self._pending, self._pending_rows = ([rest] if rest.num_rows else []), rest.num_rows

    def _close_file(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            self.files[-1]["bytes"] = os.path.getsize(os.path.join(self.folder, self.files[-1]["path"]))

    def close(self) -> dict:
        """Flush the last rows; the manifest's entry of the split."""
        while self._pending_rows:
            self._flush(self._pending_rows)
        self._close_file()
        return {"rows": sum(f["rows"] for f in self.files), "files": self.files}


class DatasetWriter:
    """A prepared dataset written into ``<dest>.tmp-<pid>`` and renamed to ``dest`` on ``commit``.

    Use as a context manager: on an exception the temporary folder is removed and ``dest`` is
    left as it was (absent, or the previous complete dataset).
    """

    def __init__(self, dest: str) -> None:
        self.dest = os.path.abspath(dest)
        self.tmp = f"{self.dest}.tmp-{os.getpid()}"
        shutil.rmtree(self.tmp, ignore_errors=True)
        os.makedirs(self.tmp)
        self.splits: dict[str, SplitWriter] = {}

    def split(self, name: str, schema, **sizes) -> SplitWriter:
        self.splits[name] = SplitWriter(self.tmp, name, schema, **sizes)
        return self.splits[name]

    def write_items(self, item_ids: np.ndarray, features: dict[str, list]) -> None:
        """``items.parquet``: ``item_id`` and a list column per item feature (values per item)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        columns = {"item_id": pa.array(np.asarray(item_ids, dtype=np.int64))}
        columns.update({ITEM_PREFIX + name: pa.array(values, type=pa.list_(pa.int64())) for name, values in features.items()})
        pq.write_table(pa.table(columns), os.path.join(self.tmp, ITEMS_FILE), compression="zstd")

    def commit(self, manifest: Manifest) -> str:
        for name, writer in self.splits.items():
            manifest.splits[name] = writer.close()
            manifest.histogram[name] = writer.counts.tolist()
        with open(os.path.join(self.tmp, MANIFEST), "w") as f:
            json.dump(manifest.to_json(), f, indent=1)
        old = None
        if os.path.exists(self.dest):
            old = f"{self.dest}.old-{os.getpid()}"
            os.replace(self.dest, old)
        os.replace(self.tmp, self.dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.dest

    def __enter__(self) -> "DatasetWriter":
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is not None:
            for writer in self.splits.values():
                if writer._writer is not None:
                    writer._writer.close()
            shutil.rmtree(self.tmp, ignore_errors=True)


def _lists(values: np.ndarray, lengths: np.ndarray, type_):
    """A pyarrow list array of ``values`` cut into rows of ``lengths``."""
    import pyarrow as pa

    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=type_))


def samples_table(samples, labels: list[str], *, actions: np.ndarray | None = None,
                  user_features: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
                  seen_items: list[np.ndarray] | None = None):
    """``Samples`` as rows of a sample file (``labels``: the names of its label columns, in order;
    ``actions``: per history event, default 1; ``user_features``: name -> (lengths, values))."""
    import pyarrow as pa

    i64, f32 = pa.int64(), pa.float32()
    L, C = samples.uih_lengths, samples.cand_counts
    columns = {
        "sample_id": pa.array(samples.sample_ids, type=i64), "user_id": pa.array(samples.user_ids, type=i64),
        "uih_items": _lists(samples.uih_values, L, i64), "uih_times": _lists(samples.uih_timestamps, L, i64),
        "uih_actions": _lists(np.ones(int(L.sum()), np.float32) if actions is None else actions, L, f32),
        "cand_items": _lists(samples.cand_values, C, i64), "cand_times": _lists(samples.cand_timestamps, C, i64),
    }
    for k, name in enumerate(labels):
        columns[LABEL_PREFIX + name] = _lists(np.ascontiguousarray(samples.labels[:, k]), C, f32)
    for name, (lengths, values) in (user_features or {}).items():
        columns[USER_PREFIX + name] = _lists(values, lengths, i64)
    if seen_items is not None:
        columns["seen_items"] = _lists(np.concatenate(seen_items) if seen_items else np.zeros(0, np.int64),
                                       np.array([len(s) for s in seen_items], dtype=np.int64), i64)
    return pa.table(columns)
