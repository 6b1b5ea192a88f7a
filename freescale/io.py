"""Atomic file writes: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import json
import os


def write_text_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_json_atomic(path: str, data) -> None:
    write_text_atomic(path, json.dumps(data, indent=2))
