"""A synthetic interaction log as Parquet event files, for measuring ``freescale prepare`` at any size.

``write_event_log(folder, events, ...)`` writes ``part-NNNNN.parquet`` files of columns ``user``,
``item`` (int64), ``rating`` (float32, 1..5) and ``timestamp`` (int64 seconds), in time order
as a production log arrives, ``rows_per_file`` rows a file, generated one row group at a time
(memory is bounded by a row group, whatever the log's size).

Users have heavy-tailed event counts: each user's share of the events is a lognormal weight
(log-space standard deviation ``user_sigma``), so most users have a few events and a few have
thousands. Items are Zipf-popular (exponent ``item_zipf``). Times advance by one second every
``events_per_second`` events, so many events share a second (ties that file order breaks).
"""

from __future__ import annotations

import os

import numpy as np

ROW_GROUP = 1 << 20
START_TIME = 1_600_000_000


def write_event_log(folder: str, events: int, *, users: int = 1_000_000, items: int = 1_000_000,
                    rows_per_file: int = 10_000_000, user_sigma: float = 1.5, item_zipf: float = 1.2,
                    events_per_second: int = 1000, seed: int = 0) -> list[str]:
    """Write ``events`` events into ``folder``; the paths of the files, in order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    cdf = np.cumsum(rng.lognormal(0.0, user_sigma, users))
    cdf /= cdf[-1]
    os.makedirs(folder, exist_ok=True)
    paths = []
    for start in range(0, events, rows_per_file):
        path = os.path.join(folder, f"part-{len(paths):05d}.parquet")
        tmp = path + ".tmp"
        with pq.ParquetWriter(tmp, pa.schema([("user", pa.int64()), ("item", pa.int64()), ("rating", pa.float32()),
                                              ("timestamp", pa.int64())]), compression="zstd") as writer:
            for first in range(start, min(start + rows_per_file, events), ROW_GROUP):
                n = min(ROW_GROUP, start + rows_per_file - first, events - first)
                user = np.minimum(np.searchsorted(cdf, rng.random(n)), users - 1)
                item = (rng.zipf(item_zipf, n) - 1) % items
                rating = rng.integers(1, 6, n).astype(np.float32)
                stamp = START_TIME + (first + np.arange(n, dtype=np.int64)) // events_per_second
                writer.write_table(pa.table({"user": user, "item": item, "rating": rating, "timestamp": stamp}))
        os.replace(tmp, path)
        paths.append(path)
    return paths
