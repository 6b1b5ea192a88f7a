"""Interaction logs of the formats ``freescale prepare`` reads, loaded into one DuckDB table.

Every format ends up as the rows of ``EVENTS`` (``user_key``, ``item_key``, ``rating`` and ``ts``
as DOUBLE: the rating or action value of the event and its time in seconds), in file order: the files in the order given (a glob's matches sorted by name), each file's rows in their
order, so the table's ``rowid`` breaks ties of time the way ``readers.read_ratings``'s line
order does. DuckDB parses the files (never Python), with every parsing option set, so nothing
is guessed from a sample of the rows:

=========  ===================================================================================
format     files
=========  ===================================================================================
ml100k     MovieLens-100K ``u.data`` (tab-separated user, item, rating, timestamp) or RecBole's
           ``ml-100k.inter`` (the same with a ``user_id:token ...`` header line)
ml1m       MovieLens-1M/10M ``ratings.dat``: ``user::item::rating::timestamp``
ml20m      MovieLens-20M/25M/32M ``ratings.csv``: header ``userId,movieId,rating,timestamp``
recbole    a RecBole atomic ``.inter`` file: tab-separated, header ``user_id:token item_id:token
           [rating:float] timestamp:float`` in any order (no rating: every event rates 1)
csv        ``user,item,rating,timestamp`` with or without a header line; with ``columns`` a CSV
           with a header, the columns named there
amazon     Amazon Reviews: the ratings-only CSV ``item,user,rating,timestamp`` (2014, 2018), or
           JSON lines with ``reviewerID, asin, overall, unixReviewTime`` (2014, 2018) or
           ``user_id, parent_asin, rating, timestamp`` (2023, milliseconds); ``.gz`` too
kuairand   KuaiRand ``log_standard_*.csv`` (header ``user_id,video_id,...,time_ms,is_click,...``):
           the event's value is a bit mask of its ``signals`` (bit k: signal k is 1), which
           become the labels
events     a CSV (with a header) or Parquet event log, the columns named in ``columns``
           (``user``, ``item``, ``time``, optional ``rating``); ``time_unit`` scales the time
=========  ===================================================================================

Bad input raises ``DataError`` with one line naming the file (and the line or row, and the
column): a missing file or column, a row with too few or too many fields, a value that is not
a number, an empty id, a time that is not finite.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from dataclasses import dataclass, field

from freescale.data.errors import DataError

EVENTS = "events_raw"
"""The DuckDB table every format loads into."""
FORMATS = ("ml100k", "ml1m", "ml20m", "recbole", "csv", "amazon", "kuairand", "events")
ROLES = ("user", "item", "time", "rating")
"""What a column of an event log can be (``columns``' keys)."""
TIME_UNITS = {"s": 1.0, "ms": 1e3, "us": 1e6, "ns": 1e9}
KUAIRAND_SIGNALS = ("is_click", "is_like", "is_follow", "is_comment", "is_forward", "is_hate", "long_view",
                    "is_profile_enter")
"""The 0/1 columns of a KuaiRand log that can be labels."""
KUAIRAND_DEFAULT_SIGNALS = ("is_click", "long_view", "is_like")
PARQUET_SUFFIXES = (".parquet", ".pq")


@dataclass(frozen=True)
class LogOptions:
    columns: dict = field(default_factory=dict)
    """role -> column name (csv with a header, events)."""
    time_unit: str = "s"
    """events: the unit of a numeric time column."""
    signals: tuple = ()
    """kuairand: the 0/1 columns that become labels, in order (bit k of the event's value)."""


def expand_inputs(patterns: list[str]) -> list[str]:
    """The files of ``patterns`` in order: each pattern a path or a glob (its matches sorted)."""
    files = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
            if not matches:
                raise DataError(f"no files match {pattern}")
            files.extend(matches)
        elif not os.path.isfile(pattern):
            raise DataError(f"events file not found: {pattern}")
        else:
            files.append(pattern)
    return files


def check_options(fmt: str, options: LogOptions) -> None:
    """One line naming the flag when ``options`` do not fit ``fmt``."""
    if fmt not in FORMATS:
        raise DataError(f"--format: expected one of {', '.join(FORMATS)}, got {fmt!r}")
    if options.columns and fmt not in ("csv", "events"):
        raise DataError(f"--columns: only for --format csv or events (format {fmt} names its own columns)")
    for role in options.columns:
        if role not in ROLES:
            raise DataError(f"--columns: unknown role {role!r} (expected {', '.join(ROLES)})")
    if fmt == "events":
        missing = [r for r in ("user", "item", "time") if r not in options.columns]
        if missing:
            raise DataError(f"--columns: format events needs {', '.join(f'{r}=COLUMN' for r in missing)}")
    if options.time_unit not in TIME_UNITS:
        raise DataError(f"--time-unit: expected one of {', '.join(TIME_UNITS)}, got {options.time_unit!r}")
    if options.time_unit != "s" and fmt != "events":
        raise DataError(f"--time-unit: only for --format events (format {fmt} has a known unit)")
    if options.signals and fmt != "kuairand":
        raise DataError("--labels: only for --format kuairand (the other formats label by rating thresholds)")
    for s in options.signals:
        if s not in KUAIRAND_SIGNALS:
            raise DataError(f"--labels: expected KuaiRand columns among {', '.join(KUAIRAND_SIGNALS)}, got {s!r}")


def load_events(con, fmt: str, files: list[str], options: LogOptions, log=lambda message: None) -> int:
    """Load ``files`` of format ``fmt`` into ``EVENTS``, in file order; the number of events."""
    table = _EventTable(con)
    for k, path in enumerate(files):
        log(f"reading {path} ({k + 1}/{len(files)}, {os.path.getsize(path) / 2**20:.1f} MiB)")
        if not path.endswith(PARQUET_SUFFIXES) and not _first_line(path):
            continue  # an empty text file holds no events (and no header to check)
        _LOADERS[fmt](table, path, options)
    if table.rows == 0:
        raise DataError(f"{files[0] if len(files) == 1 else f'{len(files)} files ({files[0]}, ...)'}: no events")
    return table.rows


# ---------------------------------------------------------------------------------------------
# The table and its checks
# ---------------------------------------------------------------------------------------------


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _text(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


_KEYS = ("user_key", "item_key")


class _EventTable:
    """Appends one file's events at a time and checks them (its rows are ``rowid`` first .. rows-1)."""

    def __init__(self, con) -> None:
        self.con = con
        self.rows = 0
        self.key_types: dict[str, str] = {}  # user_key, item_key -> BIGINT or VARCHAR, once created

    def add(self, path: str, source: str, *, user: str, item: str, rating: str, time: str, rejects: bool,
            integer_ids: tuple[bool, bool] = (False, False)) -> None:
        """Append ``SELECT user, item, rating, time FROM source`` (SQL expressions over the source's
        columns); ``rejects``: the source is a CSV scan that stores its bad lines; ``integer_ids``:
        whether the user and item columns are integer columns (else text)."""
        import duckdb

        wanted = {key: "BIGINT" if integer else "VARCHAR" for key, integer in zip(_KEYS, integer_ids)}
        if not self.key_types:
            self.key_types = wanted
            self.con.execute(f"CREATE TABLE {EVENTS} (user_key {wanted['user_key']}, item_key {wanted['item_key']}, "
                             f"rating DOUBLE, ts DOUBLE)")
        for key in _KEYS:
            if self.key_types[key] == "BIGINT" and wanted[key] == "VARCHAR":
                self.con.execute(f"ALTER TABLE {EVENTS} ALTER {key} TYPE VARCHAR")
                self.key_types[key] = "VARCHAR"
        ids = [f"CAST({expr} AS BIGINT)" if self.key_types[key] == "BIGINT" else
               f"CAST({expr} AS VARCHAR)" if integer else f"trim(CAST({expr} AS VARCHAR))"
               for key, expr, integer in zip(_KEYS, (user, item), integer_ids)]
        if rejects:
            self.con.execute("DROP TABLE IF EXISTS reject_errors; DROP TABLE IF EXISTS reject_scans")
        try:
            self.con.execute(f"INSERT INTO {EVENTS} SELECT {ids[0]}, {ids[1]}, {rating}, {time} FROM {source}")
        except duckdb.OutOfMemoryException:
            raise  # the engine's memory, not the file
        except duckdb.Error as e:
            raise DataError(f"{path}: {_duckdb_line(e)}") from None
        if rejects:
            bad = self.con.execute("SELECT line, column_name, error_type, error_message FROM reject_errors "
                                   "ORDER BY line LIMIT 1").fetchall()
            if bad:
                line, column, kind, message = bad[0]
                if kind == "CAST":
                    raise DataError(f"{path}:{line}: column {column}: {message.split('. ', 1)[-1].strip()}")
                raise DataError(f"{path}:{line}: {message} ({kind.lower()})")
        first = self.rows
        self.rows = self.con.execute(f"SELECT count(*) FROM {EVENTS}").fetchall()[0][0]
        self._check(path, first)

    def _check(self, path: str, first: int) -> None:
        empty = {key: f"{key} IS NULL" + (f" OR {key} = ''" if self.key_types[key] == "VARCHAR" else "") for key in _KEYS}
        what = {"no user id": empty["user_key"], "no item id": empty["item_key"], "no rating": "rating IS NULL", "no time": "ts IS NULL",
                "a time that is not a finite number": "NOT isfinite(ts)",
                "a rating that is not a finite number": "NOT isfinite(rating)"}
        cases = " ".join(f"WHEN {cond} THEN {_text(name)}" for name, cond in what.items())
        bad = self.con.execute(f"SELECT rowid - {first} + 1, CASE {cases} END AS problem FROM {EVENTS} "
                               f"WHERE rowid >= {first} AND problem IS NOT NULL ORDER BY rowid LIMIT 1").fetchall()
        if bad:
            raise DataError(f"{path}: event {bad[0][0]} (counting from 1 in the file) has {bad[0][1]}")


def _duckdb_line(error: Exception) -> str:
    """DuckDB's message without its class prefix and its advice: the first line."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text.split(": ", 1)[1] if text.split(": ", 1)[0].endswith("Error") and ": " in text else text


def _first_line(path: str) -> str:
    """The first non-empty line of a text file (gzip-compressed when its name ends in .gz)."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.strip():
                    return line.rstrip("\r\n")
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: cannot read ({e})") from None
    return ""


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _csv_scan(path: str, *, delim: str, header: bool, names: list[str], numeric: set[str]) -> str:
    """A ``read_csv`` of ``path`` with every option set: columns ``names`` (those in ``numeric``
    DOUBLE, the others text), no quoting; bad lines are stored as rejects, not skipped silently."""
    columns = ", ".join(f"{_text(n)}: {_text('DOUBLE' if n in numeric else 'VARCHAR')}" for n in names)
    return (f"read_csv({_text(path)}, auto_detect=false, delim={_text(delim)}, quote='', escape='', "
            f"header={'true' if header else 'false'}, columns={{{columns}}}, store_rejects=true, "
            f"rejects_limit=10, compression='auto')")


def _header_names(path: str, line: str, delim: str, required: list[str]) -> list[str]:
    """The column names of a header line, with ``required`` among them."""
    names = [n.strip().strip('"') for n in line.split(delim)]
    missing = [r for r in required if r not in names]
    if missing:
        raise DataError(f"{path}: no column {', '.join(repr(m) for m in missing)} in the header "
                        f"(columns: {', '.join(names)})")
    return names


def _fields(path: str, line: str, delim: str, count: int) -> None:
    got = len(line.split(delim))
    if got != count:
        raise DataError(f"{path}:1: expected {count} fields separated by {delim!r}, got {got}")


# ---------------------------------------------------------------------------------------------
# The formats
# ---------------------------------------------------------------------------------------------

_POSITIONAL = ["user", "item", "rating", "timestamp"]


def _four_fields(table: _EventTable, path: str, delim: str, *, header: bool | None = None,
                 order: list[str] = _POSITIONAL) -> None:
    """``user, item, rating, timestamp`` (in ``order``) separated by ``delim``; ``header`` None:
    a first line whose rating or timestamp is not a number is a header."""
    line = _first_line(path)
    _fields(path, line, delim, 4)
    if header is None:
        parts = [x.strip() for x in line.split(delim)]
        header = not (_is_number(parts[order.index("rating")]) and _is_number(parts[order.index("timestamp")]))
    scan = _csv_scan(path, delim=delim, header=header, names=order, numeric={"rating", "timestamp"})
    table.add(path, scan, user="user", item="item", rating="rating", time="timestamp", rejects=True)


def _named_columns(table: _EventTable, path: str, delim: str, names: list[str], roles: dict[str, str], *,
                   time_scale: float = 1.0, rating: str | None = None) -> None:
    """A delimited file with a header of ``names``; ``roles``: role -> column."""
    numeric = {roles["time"]} | ({roles["rating"]} if "rating" in roles else set())
    scan = _csv_scan(path, delim=delim, header=True, names=names, numeric=numeric)
    if rating is None:
        rating = _quote(roles["rating"]) if "rating" in roles else "1.0"
    time = _quote(roles["time"]) if time_scale == 1.0 else f"{_quote(roles['time'])} / {time_scale!r}"
    table.add(path, scan, user=_quote(roles["user"]), item=_quote(roles["item"]), rating=rating, time=time,
              rejects=True)


def _load_ml100k(table: _EventTable, path: str, options: LogOptions) -> None:
    line = _first_line(path)
    if ":token" in line or ":float" in line:
        _load_recbole(table, path, options)
    else:
        _four_fields(table, path, "\t", header=False)


def _load_ml1m(table: _EventTable, path: str, options: LogOptions) -> None:
    _four_fields(table, path, "::", header=False)


def _load_ml20m(table: _EventTable, path: str, options: LogOptions) -> None:
    names = _header_names(path, _first_line(path), ",", ["userId", "movieId", "rating", "timestamp"])
    _named_columns(table, path, ",", names, {"user": "userId", "item": "movieId", "rating": "rating",
                                              "time": "timestamp"})


def _load_recbole(table: _EventTable, path: str, options: LogOptions) -> None:
    header = _first_line(path)
    names = [n.strip() for n in header.split("\t")]
    bare = [n.split(":", 1)[0] for n in names]
    missing = [r for r in ("user_id", "item_id", "timestamp") if r not in bare]
    if missing:
        raise DataError(f"{path}: no column {', '.join(repr(m) for m in missing)} in the RecBole header "
                        f"(columns: {', '.join(names)})")
    roles = {"user": names[bare.index("user_id")], "item": names[bare.index("item_id")],
             "time": names[bare.index("timestamp")]}
    if "rating" in bare:
        roles["rating"] = names[bare.index("rating")]
    _named_columns(table, path, "\t", names, roles)


def _delimiter(line: str) -> str:
    """The delimiter of a header line: the most frequent of , tab ; |."""
    return max([",", "\t", ";", "|"], key=line.count)


def _load_csv(table: _EventTable, path: str, options: LogOptions) -> None:
    if not options.columns:
        _four_fields(table, path, ",")
        return
    line = _first_line(path)
    delim = _delimiter(line)
    names = _header_names(path, line, delim, list(options.columns.values()))
    _named_columns(table, path, delim, names, options.columns)


def _load_amazon(table: _EventTable, path: str, options: LogOptions) -> None:
    line = _first_line(path)
    if not line.lstrip().startswith("{"):
        _four_fields(table, path, ",", header=False, order=["item", "user", "rating", "timestamp"])
        return
    try:
        keys = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:1: not a JSON object ({e.msg})") from None
    if "reviewerID" in keys:
        roles, scale = {"user": "reviewerID", "item": "asin", "rating": "overall", "time": "unixReviewTime"}, 1.0
    elif "parent_asin" in keys:
        roles, scale = {"user": "user_id", "item": "parent_asin", "rating": "rating", "time": "timestamp"}, 1e3
    else:
        raise DataError(f"{path}:1: expected Amazon review fields (reviewerID, asin, overall, unixReviewTime; "
                        f"or user_id, parent_asin, rating, timestamp), got {', '.join(list(keys)[:8])}")
    columns = ", ".join(f"{_text(c)}: 'VARCHAR'" for c in roles.values())
    scan = f"read_json({_text(path)}, format='newline_delimited', columns={{{columns}}}, compression='auto')"
    table.add(path, f"(SELECT * FROM {scan})", user=_quote(roles["user"]), item=_quote(roles["item"]),
              rating=_number(roles["rating"]), time=f"{_number(roles['time'])} / {scale!r}", rejects=False)


def _number(column: str) -> str:
    """SQL: ``column`` as a DOUBLE, failing with the column and value when it is not a number."""
    col = _quote(column)
    return (f"CASE WHEN {col} IS NULL OR TRY_CAST({col} AS DOUBLE) IS NOT NULL THEN TRY_CAST({col} AS DOUBLE) "
            f"ELSE error({_text(f'column {column}: ')} || CAST({col} AS VARCHAR) || ' is not a number') END")


def _load_kuairand(table: _EventTable, path: str, options: LogOptions) -> None:
    signals = list(options.signals or KUAIRAND_DEFAULT_SIGNALS)
    names = _header_names(path, _first_line(path), ",", ["user_id", "video_id", "time_ms", *signals])
    mask = " + ".join(f"{1 << k}.0 * {_quote(s)}" for k, s in enumerate(signals))
    numeric = {"time_ms", *signals}
    scan = _csv_scan(path, delim=",", header=True, names=names, numeric=numeric)
    table.add(path, scan, user="user_id", item="video_id", rating=mask, time="time_ms / 1000.0", rejects=True)


def _load_events(table: _EventTable, path: str, options: LogOptions) -> None:
    roles = options.columns
    scale = TIME_UNITS[options.time_unit]
    if not path.endswith(PARQUET_SUFFIXES):
        _load_csv_events(table, path, roles, scale)
        return
    import duckdb

    scan = f"read_parquet({_text(path)})"
    try:
        schema = dict(table.con.execute(f"SELECT column_name, column_type FROM (DESCRIBE SELECT * FROM {scan})").fetchall())
    except duckdb.Error as e:
        raise DataError(f"{path}: not a readable Parquet file ({_duckdb_line(e)})") from None
    missing = [c for c in roles.values() if c not in schema]
    if missing:
        raise DataError(f"{path}: no column {', '.join(repr(m) for m in missing)} (columns: {', '.join(schema)})")
    time_type = schema[roles["time"]]
    if time_type.startswith(("TIMESTAMP", "DATE")):
        time = f"epoch({_quote(roles['time'])})"
    elif _numeric_type(time_type):
        time = f"CAST({_quote(roles['time'])} AS DOUBLE) / {scale!r}"
    else:
        raise DataError(f"{path}: column {roles['time']} ({time_type}): expected a number or a timestamp")
    if "rating" in roles:
        if not _numeric_type(schema[roles["rating"]]):
            raise DataError(f"{path}: column {roles['rating']} ({schema[roles['rating']]}): expected a number")
        rating = f"CAST({_quote(roles['rating'])} AS DOUBLE)"
    else:
        rating = "1.0"
    table.add(path, scan, user=_quote(roles["user"]), item=_quote(roles["item"]), rating=rating, time=time,
              rejects=False, integer_ids=(schema[roles["user"]] in _INTEGER_TYPES, schema[roles["item"]] in _INTEGER_TYPES))


_INTEGER_TYPES = ("TINYINT", "SMALLINT", "INTEGER", "BIGINT", "UTINYINT", "USMALLINT", "UINTEGER")
"""Id column types kept as integers (BIGINT holds them all)."""


def _numeric_type(duckdb_type: str) -> bool:
    return duckdb_type in ("TINYINT", "SMALLINT", "INTEGER", "BIGINT", "HUGEINT", "UTINYINT", "USMALLINT",
                           "UINTEGER", "UBIGINT", "FLOAT", "DOUBLE") or duckdb_type.startswith("DECIMAL")


def _load_csv_events(table: _EventTable, path: str, roles: dict, scale: float) -> None:
    line = _first_line(path)
    delim = _delimiter(line)
    names = _header_names(path, line, delim, list(roles.values()))
    _named_columns(table, path, delim, names, roles, time_scale=scale)


_LOADERS = {"ml100k": _load_ml100k, "ml1m": _load_ml1m, "ml20m": _load_ml20m, "recbole": _load_recbole,
            "csv": _load_csv, "amazon": _load_amazon, "kuairand": _load_kuairand, "events": _load_events}
