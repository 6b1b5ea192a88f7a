"""Atomic file writes: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import json
import os


def write_text_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: str, data) -> None:
    write_text_atomic(path, json.dumps(data, indent=2))


def rewind_jsonl(path: str, keep) -> None:
    """Keep the records of a JSON-lines file that ``keep`` accepts (atomically): ``keep`` is a
    step number (the records up to it) or a predicate on a record.

    A run that resumes from the checkpoint of step N rewinds its logs to N: what was written
    after N belongs to steps that are trained again, so each step keeps one record. Records
    without a step, and lines cut short by a crash, are dropped with those after N.
    """
    if not os.path.exists(path):
        return
    if isinstance(keep, int):
        last_step = keep
        keep = lambda record: record["step"] <= last_step  # noqa: E731
    kept = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int) and keep(record):
                kept.append(line if line.endswith("\n") else line + "\n")
    write_text_atomic(path, "".join(kept))
