"""The benchmark's synthetic event log: the files, sizes, columns and order asked for, and
users with heavy-tailed event counts."""

import numpy as np
import pyarrow.parquet as pq

from freescale.data.event_log import write_event_log


def test_event_log_files_in_time_order_with_heavy_tailed_users(tmp_path):
    paths = write_event_log(str(tmp_path), 25_000, users=500, items=300, rows_per_file=10_000, events_per_second=7)
    assert [p.rsplit("/", 1)[1] for p in paths] == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    tables = [pq.read_table(p) for p in paths]
    assert [t.num_rows for t in tables] == [10_000, 10_000, 5_000]
    assert tables[0].column_names == ["user", "item", "rating", "timestamp"]
    stamps = np.concatenate([t.column("timestamp").to_numpy() for t in tables])
    assert np.all(np.diff(stamps) >= 0) and stamps[-1] - stamps[0] == 24_999 // 7
    users = np.concatenate([t.column("user").to_numpy() for t in tables])
    items = np.concatenate([t.column("item").to_numpy() for t in tables])
    assert users.min() >= 0 and users.max() < 500 and items.min() >= 0 and items.max() < 300
    counts = np.sort(np.bincount(users, minlength=500))
    assert counts[-5:].sum() > 5 * 10 * np.median(counts)  # a few users with many times the median's events
    ratings = np.concatenate([t.column("rating").to_numpy() for t in tables])
    assert set(np.unique(ratings)) == {1, 2, 3, 4, 5}
