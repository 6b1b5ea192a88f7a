"""A core made busy on purpose: a CPU-bound process pinned to it, so that whatever runs there
shares it, on an idle machine as on a loaded one."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from typing import Iterator


@contextlib.contextmanager
def busy_core() -> Iterator[set[int]]:
    """Yields ``{core}``, one of this process's cores, with a CPU-bound process spinning on it
    until the block ends (give it to ``torchrun(cpus=...)`` or ``os.sched_setaffinity``)."""
    core = {max(os.sched_getaffinity(0))}
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.sched_setaffinity(0, core))
    try:
        time.sleep(0.5)  # (up and spinning)
        yield core
    finally:
        hog.kill()
        hog.wait()
