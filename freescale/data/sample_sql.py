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

Every query orders its rows by (time of the first candidate, user, position): the samples'
global order, in which their ids are counted.
"""

from __future__ import annotations

TIMELINE = "timeline"
USER_IDS = "user_ids"
ITEM_IDS = "item_ids"
USER_COUNTS = "user_counts"
USER_SIDE = "user_side"
"""Per user index, the user side features as ``user:<name>`` list columns (optional)."""


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


def _side(user_features: list[str], table: str) -> tuple[str, str]:
    """The ``user:<name>`` columns (empty lists for a user the side file lacks) and their join."""
    if not user_features:
        return "", ""
    cols = "".join(f", coalesce(s.{ident('user:' + f)}, CAST([] AS BIGINT[])) AS {ident('user:' + f)}"
                   for f in user_features)
    return cols, f' LEFT JOIN {USER_SIDE} s ON s."user" = {table}."user"'


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


def ranking_count(min_uih_len: int, num_candidates: int) -> str:
    m, c = min_uih_len, num_candidates
    return f"SELECT coalesce(sum((n - {m} + {c - 1}) // {c}), 0) FROM {USER_COUNTS} WHERE n > {m}"


def ranking_query(min_uih_len: int, max_uih_len: int, num_candidates: int, labels: list[tuple[str, str]],
                  user_features: list[str]) -> str:
    """Every ranking sample in the global order (train then eval): ``user_id``, the history
    (``uih_items, uih_times, uih_actions``), the candidates (``cand_items, cand_times``), the labels
    (``labels``: (name, condition on the action ``r``)) and the user side features."""
    m, top, c = min_uih_len, max_uih_len, num_candidates
    before = -(-top // c)  # chunks that hold max_uih_len events
    side_cols, side_join = _side(user_features, "w")
    history = "".join(f", h_{x}[len(h_{x}) - least(w.p, {top}) + 1:] AS uih_{x}" for x in ("items", "times", "actions"))
    return f"""
        WITH chunks AS ({_lists(f"CASE WHEN pos < {m} THEN -1 ELSE (pos - {m}) // {c} END", "min", f"n > {m}")}),
        w AS (
            SELECT "user", k, p, items, times, actions,
                   flatten(list(items) OVER before) AS h_items, flatten(list(times) OVER before) AS h_times,
                   flatten(list(actions) OVER before) AS h_actions
            FROM chunks
            WINDOW before AS (PARTITION BY "user" ORDER BY k ROWS BETWEEN {before} PRECEDING AND 1 PRECEDING))
        SELECT w."user" AS user_id{history}, w.items AS cand_items, w.times AS cand_times
               {_labels(labels, "w.actions")}{side_cols}
        FROM w{side_join}
        WHERE w.k >= 0
        ORDER BY w.times[1], w."user", w.p
        """


def retrieval_train_count(min_uih_len: int, stride: int) -> str:
    m = min_uih_len
    return f"SELECT coalesce(sum((n - 2 - {m}) // {stride} + 1), 0) FROM {USER_COUNTS} WHERE n - 2 >= {m}"


def retrieval_train_query(min_uih_len: int, max_uih_len: int, stride: int, label: str,
                          user_features: list[str]) -> str:
    """Leave-one-out training windows (``readers._leave_one_out``): the candidate is the next
    item alone, label 1; windows end ``stride`` events apart, the last at the second-to-last event."""
    m, top, s = min_uih_len, max_uih_len, stride
    before = max(0, -(-(top - s + 1) // s))  # chunks before the window's own that hold max_uih_len events
    side_cols, side_join = _side(user_features, "w")
    history = "".join(f", a_{x}[len(a_{x}) - least(w.p, {top}):len(a_{x}) - 1] AS uih_{x}"
                      for x in ("items", "times", "actions"))
    return f"""
        WITH chunks AS ({_lists(f"(n - 2 - pos) // {s}", "max", f"pos <= n - 2 AND n - 2 >= {m}")}),
        w AS (
            SELECT "user", p, items, times,
                   flatten(list(items) OVER upto) AS a_items, flatten(list(times) OVER upto) AS a_times,
                   flatten(list(actions) OVER upto) AS a_actions
            FROM chunks
            WINDOW upto AS (PARTITION BY "user" ORDER BY k DESC ROWS BETWEEN {before} PRECEDING AND CURRENT ROW))
        SELECT w."user" AS user_id{history}, [w.items[-1]] AS cand_items, [w.times[-1]] AS cand_times,
               [CAST(1 AS FLOAT)] AS {ident('label:' + label)}{side_cols}
        FROM w{side_join}
        WHERE w.p >= {m}
        ORDER BY w.times[-1], w."user", w.p
        """


def retrieval_eval_count() -> str:
    return f"SELECT count(*) FROM {USER_COUNTS} WHERE n >= 2"


def retrieval_eval_query(max_uih_len: int, label: str, user_features: list[str]) -> str:
    """One held-out sample per user with two events or more: the last event is the candidate,
    ``seen_items`` every item before it."""
    top = max_uih_len
    side_cols, side_join = _side(user_features, "w")
    history = "".join(f", w.{x}[w.n - least(w.n - 1, {top}):w.n - 1] AS uih_{x}" for x in ("items", "times", "actions"))
    return f"""
        WITH w AS (SELECT *, len(items) AS n FROM ({_lists("0", "max", "n >= 2")}))
        SELECT w."user" AS user_id{history}, [w.items[w.n]] AS cand_items, [w.times[w.n]] AS cand_times,
               [CAST(1 AS FLOAT)] AS {ident('label:' + label)}{side_cols}, w.items[1:w.n - 1] AS seen_items
        FROM w{side_join}
        ORDER BY w.times[w.n], w."user"
        """
