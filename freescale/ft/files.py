"""A replica group's files in its run folder, read by the launcher (``freescale local``) as the
group writes them; no torch here, so the launcher starts without it."""

from __future__ import annotations

import json
import os
import time

from freescale.io import write_json_atomic

CURSOR_FILE = "ft_cursor.json"
COMMITS_FILE = "ft_commits.jsonl"


class ReplicaFiles:
    """A group's files in its run folder: its progress (the last committed step and the data
    cursor it left, rewritten atomically at every commit: what ``freescale local`` watches)
    and one line per commit (what it measures stalls from)."""

    def __init__(self, run_dir: str) -> None:
        self.cursor_path = os.path.join(run_dir, CURSOR_FILE)
        self.commits_path = os.path.join(run_dir, COMMITS_FILE)

    def read_cursor(self) -> dict | None:
        """``{"step", "next_batch"}`` of the last committed step, or None for a group that never committed."""
        if not os.path.exists(self.cursor_path):
            return None
        try:
            with open(self.cursor_path) as f:
                cursor = json.load(f)
            return {"step": int(cursor["step"]), "next_batch": int(cursor["next_batch"])}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{self.cursor_path}: unreadable data cursor ({e})") from e

    def write(self, step: int, next_batch: int, trained: bool, blocked_s: float = 0.0) -> None:
        """``blocked_s``: the time the group waited for the others since its last commit."""
        now = time.time()
        with open(self.commits_path, "a") as f:
            f.write(json.dumps({"step": step, "next_batch": next_batch, "trained": trained, "time": now,
                                "blocked_s": round(blocked_s, 6)}) + "\n")
        self.write_progress(step, next_batch, now)

    def write_progress(self, step: int, next_batch: int, now: float | None = None) -> None:
        """The group's state without a commit (it loaded a checkpoint)."""
        write_json_atomic(self.cursor_path, {"step": step, "next_batch": next_batch, "time": now or time.time()})
