"""A run folder's checkpoints, found by their folder names alone (no torch): what the trainer
resumes from and prunes, and what ``freescale export`` reads."""

from __future__ import annotations

import os
import re

STEP_DIR = re.compile(r"^step_(\d+)$")


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """Complete checkpoints under ``root`` as (step, path), oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = STEP_DIR.match(name)
        if m and os.path.exists(os.path.join(root, name, ".metadata")):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found)
