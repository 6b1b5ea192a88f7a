"""``freescale prepare``: an interaction log (or the synthetic stream) as a prepared dataset.

A log is cut into the samples ``readers.RatingsSource`` makes of it, the same ids, histories,
candidates, labels and order, and written in the sample-file format (``sample_files``), out of
core: the log is never held in Python. The steps, all in DuckDB:

1. load every input file into one table, in file order (``log_formats``);
2. map ids to indices and number each user's events by time (``sample_sql.timeline_statements``);
3. cut each task's samples with window functions over chunks of each user's events, one bucket
   of users at a time into one table (``sample_sql``), then read that table ordered by the time of
   each sample's first candidate and stream the rows as Arrow batches in that order into
   ``SplitWriter``; sample ids are the rows' places in the stream, the latest
   ``round(n * holdout_fraction)`` ranking samples go to the eval split (retrieval: each user's
   last event, ids after the training windows').

Why DuckDB: the cut needs per-user window functions whose frames build lists (``list(...) OVER
(PARTITION BY user ORDER BY k ROWS BETWEEN ...)``), a global sort, joins and grouped list
aggregates, on logs larger than memory. DuckDB runs them out of core: sorts, joins,
aggregates and windows spill to ``temp_directory`` under ``memory_limit`` (a grouped ``list()``
does not: hence the buckets, sized by ``_buckets``), and a query's result streams out as Arrow
record batches in its ``ORDER BY`` order (``to_arrow_reader``; the older ``fetch_record_batch``
is deprecated in duckdb 2.0), so the writer holds a batch at a time.
Polars' streaming engine lowers a per-user rolling window (``rolling(..., group_by=...)``) to its
in-memory engine (polars-stream's ``lower_group_by.rs`` streams a rolling group-by only without
keys, August 2026), and its group-by, join and sort do not spill yet (pola-rs/polars#20947).

DuckDB works in ``<out>.tmp-<pid>/_work`` (its database file and spill folder), inside the
folder ``DatasetWriter`` renames to ``<out>`` on success, so a failed run leaves nothing at
``<out>`` and a previous dataset there stays as it was.

Idempotence: the manifest's ``source`` records the inputs (absolute paths, sizes, modification
times), the format and every setting that changes the samples or the files; a second run
asking for the same ``source`` finds it in ``<out>/manifest.json`` and writes nothing. The
engine's memory limit and threads are not part of it (they change how, not what).

The synthetic stream (``prepare_synthetic``) is written block by block from
``SyntheticSource.samples_at``, for benchmarks at any size; its settings are the source.
Retrieval's negatives are never stored: a sample holds its next item alone (label 1), and the
reader draws the negatives with the run's seed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from freescale import env
from freescale.config import DataConfig, RatingsDataConfig, SyntheticDataConfig, TaskConfig
from freescale.data import sample_sql as sql
from freescale.data.errors import DataError
from freescale.data.features import NEXT_ITEM_LABEL, label_names
from freescale.data.log_formats import (EVENTS, KUAIRAND_DEFAULT_SIGNALS, LogOptions, check_options, expand_inputs,
                                        load_events)
from freescale.data.side_features import read_items, read_users
from freescale.data.sample_files import (MANIFEST, ROWS_PER_FILE, ROWS_PER_GROUP, DatasetWriter, Manifest,
                                         SampleFileError, sample_schema, samples_table)
from freescale.progress import bar

PREPARE_VERSION = 1
"""Bumped when the same inputs and settings would give different files (part of ``source``)."""
STREAM_ROWS = 8192
"""Rows per Arrow batch fetched from DuckDB (the writer holds about one at a time)."""


def _default(cls, name: str):
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


@dataclass(frozen=True)
class SampleSettings:
    """How timelines are cut; the defaults are the config's (``DataConfig``, ``RatingsDataConfig``,
    ``TaskConfig``), so a run's config and a dataset prepared with defaults agree."""

    task: str = _default(TaskConfig, "kind")
    min_uih_len: int = _default(DataConfig, "min_uih_len")
    max_uih_len: int = _default(DataConfig, "max_uih_len")
    num_candidates: int = _default(DataConfig, "num_candidates")
    holdout_fraction: float = _default(RatingsDataConfig, "holdout_fraction")
    positive_rating: float = _default(RatingsDataConfig, "positive_rating")
    more_labels: tuple = tuple(_default(RatingsDataConfig, "more_labels"))
    window_stride: int = _default(TaskConfig, "window_stride")

    def check(self) -> None:
        """One line naming the flag of the first setting out of range."""
        if self.task not in ("ranking", "retrieval"):
            raise DataError(f"--task: expected ranking or retrieval, got {self.task!r}")
        if self.min_uih_len < 1:
            raise DataError(f"--min-uih-len: expected a value >= 1, got {self.min_uih_len}")
        if self.max_uih_len < self.min_uih_len:
            raise DataError(f"--max-uih-len: expected >= --min-uih-len ({self.min_uih_len}), got {self.max_uih_len}")
        if self.num_candidates < 1:
            raise DataError(f"--num-candidates: expected a value >= 1, got {self.num_candidates}")
        if not 0.0 <= self.holdout_fraction <= 0.9:
            raise DataError(f"--holdout-fraction: expected a value in [0, 0.9], got {self.holdout_fraction}")
        if self.window_stride < 0 or self.window_stride > self.max_uih_len:
            raise DataError(f"--window-stride: expected 0 .. --max-uih-len ({self.max_uih_len}), got {self.window_stride}")
        if self.window_stride and self.task != "retrieval":
            raise DataError("--window-stride: overlapping windows cut timelines for retrieval; this is ranking")


@dataclass(frozen=True)
class Layout:
    """How the files are cut (part of the idempotence key: it changes the files)."""

    rows_per_file: int = ROWS_PER_FILE
    rows_per_group: int = ROWS_PER_GROUP

    def check(self) -> None:
        if self.rows_per_file < 1:
            raise DataError(f"--rows-per-file: expected a value >= 1, got {self.rows_per_file}")
        if self.rows_per_group < 1:
            raise DataError(f"--rows-per-group: expected a value >= 1, got {self.rows_per_group}")


@dataclass(frozen=True)
class Engine:
    """DuckDB's resources (not part of the idempotence key: they change how, not what)."""

    memory_limit: str = "2GB"
    threads: int = field(default_factory=env.cores)

    def check(self) -> None:
        if self.threads < 1:
            raise DataError(f"--threads: expected a value >= 1, got {self.threads}")


@dataclass
class Result:
    path: str
    manifest: Manifest
    up_to_date: bool
    seconds: float = 0.0
    events: int = 0


def _say(message: str) -> None:
    print(f"[prepare] {message}", file=sys.stderr, flush=True)


def _stamp(path: str) -> dict:
    st = os.stat(path)
    return {"path": os.path.abspath(path), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def _existing(out: str, source: dict) -> Manifest | None:
    """The manifest at ``out`` when it was made from ``source``; None when ``out`` is free to
    (re)write; raises when ``out`` holds something that is not a prepared dataset."""
    if not os.path.exists(out):
        return None
    if not os.path.isfile(os.path.join(out, MANIFEST)):
        if os.path.isdir(out) and not os.listdir(out):
            return None
        raise SampleFileError(f"--out: {out} exists and is not a prepared dataset (no {MANIFEST}); "
                              f"not replacing it")
    try:
        manifest = Manifest.load(out)
    except SampleFileError:
        return None
    return manifest if manifest.source == json.loads(json.dumps(source)) else None


def prepare_log(out: str, fmt: str, inputs: list[str], settings: SampleSettings = SampleSettings(), *,
                options: LogOptions = LogOptions(), users: str | None = None, items: str | None = None,
                layout: Layout = Layout(), engine: Engine = Engine(), say=_say) -> Result:
    """Cut the log ``inputs`` (format ``fmt``) into the samples of ``settings`` at ``out``."""
    started = time.monotonic()
    check_options(fmt, options)
    settings.check()
    layout.check()
    engine.check()
    files = expand_inputs(inputs)
    for what, path in (("--users", users), ("--items", items)):
        if path is not None and not os.path.isfile(path):
            raise DataError(f"{what}: side-feature file not found: {path}")
    source = {
        "prepare": PREPARE_VERSION, "format": fmt, "inputs": [_stamp(p) for p in files],
        "users": _stamp(users) if users else None, "items": _stamp(items) if items else None,
        "settings": dataclasses.asdict(settings),
        "options": {"columns": dict(options.columns), "time_unit": options.time_unit, "labels": list(options.signals)},
        "layout": dataclasses.asdict(layout),
    }
    existing = _existing(out, source)
    if existing is not None:
        return Result(os.path.abspath(out), existing, up_to_date=True)
    user_side = read_users(users) if users else None
    item_side = read_items(items) if items else None

    labels = _labels(fmt, settings, options)

    with DatasetWriter(out) as writer:
        work = os.path.join(writer.tmp, "_work")
        con = _connect(work, engine)
        try:
            events = load_events(con, fmt, files, options, log=say)
            say(f"{events} events; numbering each user's events by time")
            for statement in sql.timeline_statements(EVENTS):
                con.execute(statement)
            num_users = con.execute(f"SELECT count(*) FROM {sql.USER_IDS}").fetchall()[0][0]
            num_items = con.execute(f"SELECT count(*) FROM {sql.ITEM_IDS}").fetchall()[0][0]
            say(f"{num_users} users, {num_items} items")
            user_features = _register_users(con, user_side) if user_side else []
            if item_side:
                _write_items(con, writer, item_side)
            if settings.task == "ranking":
                counts = _write_ranking(con, writer, settings, labels, user_features, layout, events, say)
            else:
                counts = _write_retrieval(con, writer, settings, user_features, layout, events, say)
        finally:
            con.close()
            shutil.rmtree(work, ignore_errors=True)
        manifest = Manifest(
            task=settings.task, num_items=num_items, num_users=num_users, min_uih_len=settings.min_uih_len,
            max_uih_len=settings.max_uih_len,
            num_candidates=settings.num_candidates if settings.task == "ranking" else 1,
            labels=[name for name, _ in labels], user_features=user_side.features if user_side else [],
            item_features=item_side.features if item_side else [], window_stride=settings.window_stride,
            holdout_fraction=settings.holdout_fraction if settings.task == "ranking" else 0.0, source=source)
        path = writer.commit(manifest)
    say(f"wrote {counts['train']} train and {counts['eval']} eval samples to {path}")
    return Result(path, manifest, up_to_date=False, seconds=time.monotonic() - started, events=events)


def _labels(fmt: str, settings: SampleSettings, options: LogOptions) -> list[tuple[str, str]]:
    """(name, SQL condition on a candidate's action ``r``) of each label, in column order."""
    if settings.task == "retrieval":
        return [(NEXT_ITEM_LABEL, "true")]
    if fmt == "kuairand":  # the action is a bit mask of the signals
        return [(s, f"(CAST(r AS BIGINT) >> {k}) & 1 = 1")
                for k, s in enumerate(options.signals or KUAIRAND_DEFAULT_SIGNALS)]
    thresholds = [settings.positive_rating, *settings.more_labels]
    names = label_names(DataConfig(source="ratings", ratings=RatingsDataConfig(
        positive_rating=settings.positive_rating, more_labels=list(settings.more_labels))))
    return [(name, f"r >= {float(t)!r}") for name, t in zip(names, thresholds)]


def _connect(work: str, engine: Engine):
    import duckdb

    os.makedirs(work)
    con = duckdb.connect(os.path.join(work, "prepare.duckdb"))
    try:
        con.execute(f"SET memory_limit = {_literal(engine.memory_limit)}")
    except duckdb.Error as e:
        con.close()
        raise DataError(f"--memory-limit: {engine.memory_limit!r} is not a size DuckDB reads ({str(e).splitlines()[0]})") from None
    con.execute(f"SET threads = {int(engine.threads)}")
    con.execute(f"SET temp_directory = {_literal(os.path.join(work, 'spill'))}")
    con.execute("SET preserve_insertion_order = true")
    con.execute("SET enable_progress_bar = false")
    con.execute("PRAGMA disable_checkpoint_on_shutdown")  # the database is scratch, deleted after the run
    return con


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _register_users(con, side) -> list[str]:
    """The user side table ``sql.USER_SIDE`` keyed by user index; the feature names."""
    import pyarrow as pa

    columns = {"key": pa.array(side.keys, type=pa.string())}
    columns.update({f"user:{name}": pa.array(values, type=pa.list_(pa.int64())) for name, values in side.values.items()})
    arrow = pa.table(columns)
    con.register("user_side_arrow", arrow)
    names = [f.name for f in side.features]
    cols = ", ".join(f"a.{sql.ident('user:' + n)}" for n in names)
    con.execute(f'CREATE TABLE {sql.USER_SIDE} AS SELECT u.idx AS "user", {cols} '
                f"FROM user_side_arrow a JOIN {sql.USER_IDS} u ON CAST(u.key AS VARCHAR) = a.key")
    con.unregister("user_side_arrow")
    return names


def _write_items(con, writer: DatasetWriter, side) -> None:
    """``items.parquet``: every item index with its features (empty lists for an item the side file lacks)."""
    import pyarrow as pa

    columns = {"key": pa.array(side.keys, type=pa.string())}
    columns.update({name: pa.array(values, type=pa.list_(pa.int64())) for name, values in side.values.items()})
    con.register("item_side_arrow", pa.table(columns))
    cols = ", ".join(f"coalesce(a.{sql.ident(f.name)}, CAST([] AS BIGINT[])) AS {sql.ident(f.name)}" for f in side.features)
    table = con.sql(f"SELECT i.idx, {cols} FROM {sql.ITEM_IDS} i LEFT JOIN item_side_arrow a ON a.key = CAST(i.key AS VARCHAR) "
                        f"ORDER BY i.idx").to_arrow_table()
    con.unregister("item_side_arrow")
    writer.write_items(table.column("idx").to_numpy(),
                       {f.name: table.column(f.name).to_pylist() for f in side.features})


def _write_ranking(con, writer, settings: SampleSettings, labels, user_features, layout: Layout, events: int,
                   say) -> dict:
    total = con.execute(sql.ranking_count(settings.min_uih_len, settings.num_candidates)).fetchall()[0][0]
    n_eval = int(round(total * settings.holdout_fraction))
    n_train = total - n_eval
    _nonempty(n_train, "ranking", "train", settings)
    _nonempty(n_eval, "ranking", "eval", settings)
    schema = sample_schema([name for name, _ in labels], user_features, seen_items=False)
    sizes = dataclasses.asdict(layout)
    train, held = writer.split("train", schema, **sizes), writer.split("eval", schema, **sizes)
    buckets = _buckets(con, events, settings.max_uih_len, settings.num_candidates)
    say(f"cutting {total} ranking samples ({n_train} train, {n_eval} eval) in {buckets} bucket(s) of users")
    _cut(con, lambda users: sql.ranking_rows(settings.min_uih_len, settings.max_uih_len, settings.num_candidates,
                                             labels, users), buckets, say)
    _stream(con, sql.ordered(_columns(schema, user_features), user_features), [(train, n_train), (held, n_eval)], say)
    return {"train": n_train, "eval": n_eval}


def _write_retrieval(con, writer, settings: SampleSettings, user_features, layout: Layout, events: int, say) -> dict:
    stride = settings.window_stride or settings.max_uih_len
    n_train = con.execute(sql.retrieval_train_count(settings.min_uih_len, stride)).fetchall()[0][0]
    n_eval = con.execute(sql.retrieval_eval_count()).fetchall()[0][0]
    _nonempty(n_train, "retrieval", "train", settings)
    _nonempty(n_eval, "retrieval", "eval", settings)
    sizes = dataclasses.asdict(layout)
    train_schema = sample_schema([NEXT_ITEM_LABEL], user_features, seen_items=False)
    eval_schema = sample_schema([NEXT_ITEM_LABEL], user_features, seen_items=True)
    train, held = writer.split("train", train_schema, **sizes), writer.split("eval", eval_schema, **sizes)
    buckets = _buckets(con, events, settings.max_uih_len, stride)
    say(f"cutting {n_train} retrieval training windows (stride {stride}) in {buckets} bucket(s) of users")
    _cut(con, lambda users: sql.retrieval_train_rows(settings.min_uih_len, settings.max_uih_len, stride,
                                                     NEXT_ITEM_LABEL, users), buckets, say)
    _stream(con, sql.ordered(_columns(train_schema, user_features), user_features), [(train, n_train)], say)
    say(f"cutting {n_eval} held-out samples (each user's last event)")
    _cut(con, lambda users: sql.retrieval_eval_rows(settings.max_uih_len, NEXT_ITEM_LABEL, users), buckets, say)
    _stream(con, sql.ordered(_columns(eval_schema, user_features), user_features), [(held, n_eval)], say,
            first_id=n_train)
    return {"train": n_train, "eval": n_eval}


def _columns(schema, user_features: list[str]) -> list[str]:
    """The columns ``SAMPLES`` gives a split of ``schema`` (all but the id and the side features)."""
    side = {f"user:{f}" for f in user_features}
    return [name for name in schema.names if name != "sample_id" and name not in side]


def _buckets(con, events: int, max_uih_len: int, events_per_sample: int) -> int:
    """User buckets that bound a cut's grouped lists to half DuckDB's memory limit (those do not
    spill). A bucket's event costs its list entries and structs, about 72 bytes, and its share of
    the histories' copies, 24 bytes per event of a history over ``events_per_sample`` events per
    sample, twice over for the operators' working copies."""
    limit = memory_bytes(con.execute("SELECT current_setting('memory_limit')").fetchall()[0][0])
    per_event = 2 * (72 + 24 * -(-max_uih_len // events_per_sample))
    return max(1, -(-events * per_event // (limit // 2)))


def memory_bytes(text: str) -> int:
    """Bytes of a DuckDB size (``953.6 MiB``, ``2GB``: decimal units, binary ones with an i)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGTP]?)(i?)B?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise DataError(f"--memory-limit: cannot read {text!r} as a size")
    power = "KMGTP".find(m.group(2).upper()) + 1 if m.group(2) else 0
    return int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** power)


def _cut(con, rows, buckets: int, say) -> None:
    """``SAMPLES`` := the rows of ``rows(users)`` for every bucket of users."""
    con.execute(f"DROP TABLE IF EXISTS {sql.SAMPLES}")
    for b in range(buckets):
        query = rows(sql.bucket(b, buckets))
        con.execute(f"CREATE TABLE {sql.SAMPLES} AS {query}" if b == 0 else f"INSERT INTO {sql.SAMPLES} {query}")
        if buckets > 1 and (b + 1) % max(1, buckets // 10) == 0:
            say(f"bucket {b + 1}/{buckets} cut")


def _nonempty(count: int, task: str, split: str, settings: SampleSettings) -> None:
    if count == 0:
        raise DataError(f"the log yields no {task} {split} samples (min_uih_len={settings.min_uih_len}, "
                        f"holdout_fraction={settings.holdout_fraction})")


def _stream(con, query: str, parts: list, say, first_id: int = 0) -> None:
    """Write the rows of ``query``, in order, to ``parts``' writers: (writer, rows) each, the
    first rows to the first writer; a row's ``sample_id`` is ``first_id`` + its place."""
    import pyarrow as pa

    total = sum(rows for _, rows in parts)
    reader = con.sql(query).to_arrow_reader(STREAM_ROWS)
    next_id, part, left = first_id, 0, parts[0][1]
    step = max(total // 10, 1)
    reported = 0
    with bar(total=total, unit="samples", desc="samples") as progress:
        for batch in reader:
            while batch.num_rows:
                while left == 0:
                    part += 1
                    left = parts[part][1]
                take = min(left, batch.num_rows)
                head = batch.slice(0, take)
                ids = pa.array(np.arange(next_id, next_id + take, dtype=np.int64))
                parts[part][0].write(pa.RecordBatch.from_arrays([ids, *head.columns], ["sample_id", *head.schema.names]))
                next_id += take
                left -= take
                batch = batch.slice(take)
                progress.update(take)
            if progress.disable and next_id - first_id - reported >= step:
                reported = next_id - first_id
                say(f"{reported}/{total} samples written")
    if next_id - first_id != total:
        raise SampleFileError(f"expected {total} samples, the query gave {next_id - first_id}")


# ---------------------------------------------------------------------------------------------
# The synthetic stream
# ---------------------------------------------------------------------------------------------


def prepare_synthetic(out: str, rows: int, eval_rows: int, cfg: SyntheticDataConfig, *, seed: int = 0,
                      settings: SampleSettings = SampleSettings(), layout: Layout = Layout(), say=_say) -> Result:
    """``rows`` training and ``eval_rows`` held-out samples of ``SyntheticSource`` at ``out``
    (positions 0 .. rows-1 of each split's stream); retrieval keeps the next item alone."""
    started = time.monotonic()
    settings.check()
    layout.check()
    if rows < 1:
        raise DataError(f"--synthetic: expected a number of samples >= 1, got {rows}")
    if eval_rows < 1:
        raise DataError(f"--eval-samples: expected a value >= 1, got {eval_rows}")
    source = {"prepare": PREPARE_VERSION, "synthetic": dataclasses.asdict(cfg), "seed": seed, "rows": rows,
              "eval_rows": eval_rows, "task": settings.task, "min_uih_len": settings.min_uih_len,
              "max_uih_len": settings.max_uih_len, "num_candidates": settings.num_candidates,
              "layout": dataclasses.asdict(layout)}
    existing = _existing(out, source)
    if existing is not None:
        return Result(os.path.abspath(out), existing, up_to_date=True)
    from freescale.data.synthetic import BLOCK, SyntheticSource  # torch: only for the synthetic stream

    labels = label_names(DataConfig(source="synthetic", synthetic=cfg), settings.task)
    schema = sample_schema(labels, [], seen_items=False)
    with DatasetWriter(out) as writer:
        for split, count in (("train", rows), ("eval", eval_rows)):
            src = SyntheticSource(cfg, seed=seed, split=split, min_uih_len=settings.min_uih_len,
                                  max_uih_len=settings.max_uih_len, num_candidates=settings.num_candidates,
                                  task=settings.task, num_negatives=0)
            part = writer.split(split, schema, **dataclasses.asdict(layout))
            say(f"{split}: {count} synthetic samples")
            with bar(total=count, unit="samples", desc=split) as progress:
                for start in range(0, count, BLOCK):
                    positions = np.arange(start, min(start + BLOCK, count), dtype=np.int64)
                    part.write(samples_table(src.samples_at(positions), labels))
                    progress.update(len(positions))
        manifest = Manifest(task=settings.task, num_items=cfg.num_items, num_users=cfg.num_users,
                            min_uih_len=settings.min_uih_len, max_uih_len=settings.max_uih_len,
                            num_candidates=settings.num_candidates if settings.task == "ranking" else 1,
                            labels=labels, source=source)
        path = writer.commit(manifest)
    say(f"wrote {rows} train and {eval_rows} eval synthetic samples to {path}")
    return Result(path, manifest, up_to_date=False, seconds=time.monotonic() - started)


def prepared_ml100k(data_cfg: DataConfig, task_cfg: TaskConfig) -> str:
    """``data.source ml100k``: MovieLens-100K (downloaded once) prepared once per sample settings
    into ``<data.ratings.cache>/ml100k-<task>-<settings hash>``, with its user and item features;
    the folder's path. Ranks of one host may call it at once: one prepares while the others wait
    on a lock, then find the dataset up to date."""
    import fcntl
    import hashlib

    from freescale.data.ml100k import ensure_ml100k, ensure_ml100k_features

    r = data_cfg.ratings
    settings = SampleSettings(task=task_cfg.kind, min_uih_len=data_cfg.min_uih_len, max_uih_len=data_cfg.max_uih_len,
                              num_candidates=data_cfg.num_candidates, holdout_fraction=r.holdout_fraction,
                              positive_rating=r.positive_rating, more_labels=tuple(r.more_labels),
                              window_stride=task_cfg.window_stride)
    key = hashlib.sha256(json.dumps(dataclasses.asdict(settings), sort_keys=True).encode()).hexdigest()[:12]
    out = os.path.join(r.cache, f"ml100k-{settings.task}-{key}")
    log = ensure_ml100k(r.cache)
    users, items = ensure_ml100k_features(r.cache)
    with open(os.path.join(r.cache, ".ml100k-prepare.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        prepare_log(out, "ml100k", [log], settings, users=users, items=items, engine=Engine(memory_limit="1GB", threads=1),
                    say=lambda m: None)
    return out
