"""The suite's files run slowest first, from a record of how long each took.

``pytest -n 2 --dist loadfile`` hands whole files to its two workers in the order of the
collection. pytest-xdist's own order puts the files with the most tests first, so the few
files that each train for minutes came last, and one worker ran its last long file while the
other sat idle. Longest first keeps the workers' ends together. A file missing from the record
(a new one) runs first: it may be slow.

``pytest --record-durations`` writes what each file took (setup, call and teardown of its
tests, in seconds) into ``tests/file_durations.json``, merged with the files it did not run.
"""

import json
import os
from pathlib import Path

RECORD = Path(__file__).resolve().parents[1] / "file_durations.json"


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def read_record(path: Path = RECORD) -> dict[str, float]:
    """The recorded seconds per file ({} where there is no record)."""
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except FileNotFoundError:
        return {}


def slowest_first(nodeids: list[str], seconds: dict[str, float]) -> list[int]:
    """The positions of ``nodeids`` reordered: files by recorded seconds, longest first (files
    without a record before all), ties and each file's own tests in their collected order."""
    first: dict[str, int] = {}
    for i, nodeid in enumerate(nodeids):
        first.setdefault(file_of(nodeid), i)

    def key(i: int) -> tuple[float, int]:
        f = file_of(nodeids[i])
        return -seconds.get(f, float("inf")), first[f]

    return sorted(range(len(nodeids)), key=key)


def write_record(seconds: dict[str, float], path: Path = RECORD) -> None:
    """Merge ``seconds`` into the record at ``path``, atomically."""
    merged = {**read_record(path), **seconds}
    text = json.dumps({f: round(s, 1) for f, s in sorted(merged.items())}, indent=1) + "\n"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
