"""The DuckDB SQL that cuts a log's timelines into samples, exactly as ``readers.RatingsSource`` does.

``TIMELINE`` is built once from the loaded events (``log_formats.EVENTS``): user and item ids
become contiguous indices in the sorted order of their text (``np.unique`` of the strings: DuckDB
compares text byte-wise, which for UTF-8 is code-point order; integer ids are sorted as text too), each user's events are numbered
``pos`` 0, 1, ... by (time, file order), and times are rounded half to even to whole seconds
(``round_even``, as ``np.rint``). The sample queries then read only ``TIMELINE``.

Both tasks cut a timeline into *chunks* of consecutive events and compute each sample from one
chunk row: a window function over the user's chunk rows collects the history, so the work is
proportional to the samples written, not to every event times the history length (a window
over the events would build a ``max_uih_len`` list at every event, to keep one in
``num_candidates``).

- Ranking: chunk ``k >= 0`` holds the events at positions ``min_uih_len + k*C ..`` (``C =
  num_candidates``): exactly the candidates of the user's ``k``-th sample; the events before
  ``min_uih_len`` form chunk -1. The history is the last ``min(pos, max_uih_len)`` events of the
  ``ceil(max_uih_len / C)`` chunks before (all of them when there are fewer).
- Retrieval training: chunk ``k`` holds the events ``(p_k - stride, p_k]`` with ``p_k = n - 2 -
  k * stride``: its last event is the candidate of window ``k``, the others and the chunks
  before it the history. The user's last event belongs to no chunk.
- Retrieval eval: one row per user with at least two events, from the user's whole list.

Each query cuts the samples of one *bucket* of users (``"user" % buckets = b``) into
``SAMPLES``, with their sort keys (``t0``: the first candidate's time, ``user_id``, ``p``: its
position); ``ordered`` then reads every bucket's samples in the global order, (time of the first
candidate, user, position), in which their ids are counted. The buckets bound the memory of the
grouped ``list()`` aggregates, which DuckDB cannot spill to disk (its sorts, joins and windows
spill): a bucket holds about ``1 / buckets`` of the events.
"""

from __future__ import annotations

TIMELINE = "timeline"
USER_IDS = "user_ids"
ITEM_IDS = "item_ids"
USER_COUNTS = "user_counts"
USER_SIDE = "user_side"
"""Per user index, the user side features as ``user:<name>`` list columns (optional)."""
SAMPLES = "samples"
"""The cut samples of one split with their sort keys, bucket by bucket (``ordered`` reads them)."""


def ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def timeline_statements(events: str) -> list[str]:
    """Build ``USER_IDS``, ``ITEM_IDS``, ``TIMELINE`` and ``USER_COUNTS`` from ``events``
    (``user_key, item_key, rating, ts``; ``rowid`` in file order), then drop ``events``."""
    return [
        f"CREATE TABLE {USER_IDS} AS SELECT key, CAST(row_number() OVER (ORDER BY CAST(key AS VARCHAR)) - 1 AS BIGINT) "
        f"AS idx FROM (SELECT DISTINCT user_key AS key FROM {events})",
        f"CREATE TABLE {ITEM_IDS} AS SELECT key, CAST(row_number() OVER (ORDER BY CAST(key AS VARCHAR)) - 1 AS BIGINT) "
        f"AS idx FROM (SELECT DISTINCT item_key AS key FROM {events})",
        f"""CREATE TABLE {TIMELINE} AS
            SELECT u.idx AS "user", i.idx AS item, e.rating, CAST(round_even(e.ts, 0) AS BIGINT) AS t,
                   row_number() OVER (PARTITION BY u.idx ORDER BY e.ts, e.rowid) - 1 AS pos,
                   count(*) OVER (PARTITION BY u.idx) AS n
            FROM {events} e JOIN {USER_IDS} u ON e.user_key = u.key JOIN {ITEM_IDS} i ON e.item_key = i.key""",
        f"DROP TABLE {events}",
        f'CREATE TABLE {USER_COUNTS} AS SELECT "user", count(*) AS n FROM {TIMELINE} GROUP BY "user"',
    ]


def _labels(labels: list[tuple[str, str]], actions: str) -> str:
    """``label:<name>`` columns: each candidate's ``condition`` on its action ``r``, as 0/1 floats."""
    return "".join(f", list_transform({actions}, lambda r: CAST({cond} AS FLOAT)) AS {ident('label:' + name)}"
                   for name, cond in labels)


def _lists(key: str, anchor: str, where: str) -> str:
    """Per (user, ``key``): the events' ``items``, ``times`` and ``actions`` lists in timeline
    order, and ``p``, the ``anchor`` (min or max) of their positions. The events are gathered as
    one list of structs sorted once (a struct sorts by its first field, the position): three
    ordered aggregates would sort three times, about three times slower."""
    fields = "".join(f", list_transform(ev, lambda e: e.{x}) AS {name}"
                     for x, name in (("item", "items"), ("t", "times"), ("rating", "actions")))
    return f"""
        SELECT "user", k, p{fields} FROM (
            SELECT "user", {key} AS k, {anchor}(pos) AS p,
                   list_sort(list({{'pos': pos, 'item': item, 't': t, 'rating': rating}})) AS ev
            FROM {TIMELINE} WHERE {where} GROUP BY "user", k)"""


def bucket(b: int, buckets: int) -> str:
    """SQL: the users of bucket ``b`` of ``buckets``."""
    return "true" if buckets == 1 else f'"user" % {buckets} = {b}'


def ranking_count(min_uih_len: int, num_candidates: int) -> str:
    m, c = min_uih_len, num_candidates
    return f"SELECT coalesce(sum((n - {m} + {c - 1}) // {c}), 0) FROM {USER_COUNTS} WHERE n > {m}"


def ranking_rows(min_uih_len: int, max_uih_len: int, num_candidates: int, labels: list[tuple[str, str]],
                 users: str) -> str:
    """The ranking samples of the ``users`` (an SQL condition): ``user_id``, the history
    (``uih_items, uih_times, uih_actions``), the candidates (``cand_items, cand_times``), the labels
    (``labels``: (name, condition on the action ``r``)), and the sort keys ``t0`` and ``p``."""
    m, top, c = min_uih_len, max_uih_len, num_candidates
    before = -(-top // c)  # chunks that hold max_uih_len events
    history = "".join(f", h_{x}[len(h_{x}) - least(p, {top}) + 1:] AS uih_{x}" for x in ("items", "times", "actions"))
    return f"""
        WITH chunks AS ({_lists(f"CASE WHEN pos < {m} THEN -1 ELSE (pos - {m}) // {c} END", "min",
                                f"n > {m} AND {users}")}),
        w AS (
            SELECT "user", k, p, items, times, actions,
                   flatten(list(items) OVER before) AS h_items, flatten(list(times) OVER before) AS h_times,
                   flatten(list(actions) OVER before) AS h_actions
            FROM chunks
            WINDOW before AS (PARTITION BY "user" ORDER BY k ROWS BETWEEN {before} PRECEDING AND 1 PRECEDING))
        SELECT "user" AS user_id{history}, items AS cand_items, times AS cand_times
               {_labels(labels, "actions")}, times[1] AS t0, p
        FROM w WHERE k >= 0"""


def retrieval_train_count(min_uih_len: int, stride: int) -> str:
    m = min_uih_len
    return f"SELECT coalesce(sum((n - 2 - {m}) // {stride} + 1), 0) FROM {USER_COUNTS} WHERE n - 2 >= {m}"


def retrieval_train_rows(min_uih_len: int, max_uih_len: int, stride: int, label: str, users: str) -> str:
    """Leave-one-out training windows of the ``users`` (``readers._leave_one_out``): the candidate
    is the next item alone, label 1; windows end ``stride`` events apart, the last at the
    second-to-last event."""
    m, top, s = min_uih_len, max_uih_len, stride
    before = max(0, -(-(top - s + 1) // s))  # chunks before the window's own that hold max_uih_len events
    history = "".join(f", a_{x}[len(a_{x}) - least(p, {top}):len(a_{x}) - 1] AS uih_{x}"
                      for x in ("items", "times", "actions"))
    return f"""
        WITH chunks AS ({_lists(f"(n - 2 - pos) // {s}", "max", f"pos <= n - 2 AND n - 2 >= {m} AND {users}")}),
        w AS (
            SELECT "user", p, items, times,
                   flatten(list(items) OVER upto) AS a_items, flatten(list(times) OVER upto) AS a_times,
                   flatten(list(actions) OVER upto) AS a_actions
            FROM chunks
            WINDOW upto AS (PARTITION BY "user" ORDER BY k DESC ROWS BETWEEN {before} PRECEDING AND CURRENT ROW))
        SELECT "user" AS user_id{history}, [items[-1]] AS cand_items, [times[-1]] AS cand_times,
               [CAST(1 AS FLOAT)] AS {ident('label:' + label)}, times[-1] AS t0, p
        FROM w WHERE p >= {m}"""


def retrieval_eval_count() -> str:
    return f"SELECT count(*) FROM {USER_COUNTS} WHERE n >= 2"


def retrieval_eval_rows(max_uih_len: int, label: str, users: str) -> str:
    """One held-out sample per user of the ``users`` with two events or more: the last event is
    the candidate, ``seen_items`` every item before it."""
    top = max_uih_len
    history = "".join(f", {x}[n - least(n - 1, {top}):n - 1] AS uih_{x}" for x in ("items", "times", "actions"))
    return f"""
        WITH w AS (SELECT *, len(items) AS n FROM ({_lists("0", "max", f"n >= 2 AND {users}")}))
        SELECT "user" AS user_id{history}, [items[n]] AS cand_items, [times[n]] AS cand_times,
               [CAST(1 AS FLOAT)] AS {ident('label:' + label)}, items[1:n - 1] AS seen_items, times[n] AS t0, n - 1 AS p
        FROM w"""


def ordered(columns: list[str], user_features: list[str]) -> str:
    """Every sample of ``SAMPLES`` in the global order: ``columns``, then the ``user:<name>`` side
    features (empty lists for a user the side file lacks)."""
    cols = ", ".join(f"x.{ident(c)}" for c in columns)
    side = "".join(f", coalesce(s.{ident('user:' + f)}, CAST([] AS BIGINT[])) AS {ident('user:' + f)}"
                   for f in user_features)
    join = f' LEFT JOIN {USER_SIDE} s ON s."user" = x.user_id' if user_features else ""
    return f"SELECT {cols}{side} FROM {SAMPLES} x{join} ORDER BY x.t0, x.user_id, x.p"
