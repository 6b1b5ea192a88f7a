"""Progress bars: on stderr when it is a terminal, never in a pipe or a log; and FreeScale's
phases as torch.profiler ranges."""

import fcntl
import io
import os
import pty
import struct
import subprocess
import sys
import termios

import torch

from freescale.profile.timeline import StepTimeline
from freescale.progress import bar, on_terminal
from helpers.launch import QUICKSTART, REPO

SMALL = ["--data.max_uih_len=32", "--data.num_candidates=2", "--model.num_layers=1", "--model.embedding_dim=16",
         "--model.num_heads=2", "--model.mlp_dims=[8]", "--data.batch_size=16"]


def test_a_bar_shows_only_on_a_terminal():
    assert bar(range(3), stream=io.StringIO()).disable
    primary, secondary = pty.openpty()
    with os.fdopen(secondary, "w") as terminal:
        assert on_terminal(terminal)
        shown = bar(range(3), stream=terminal, desc="work")
        assert not shown.disable
        list(shown)
    os.close(primary)


def _calibrate(tmp_path, stderr):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "freescale", "calibrate", "--config", str(QUICKSTART), *SMALL,
                             "--repeats=1", f"--out={tmp_path / 'cost.json'}"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=stderr)


def test_calibrate_draws_its_bar_on_a_terminal_and_not_in_a_pipe(tmp_path):
    piped = _calibrate(tmp_path, subprocess.PIPE)
    out, err = piped.communicate(timeout=300)
    assert piped.returncode == 0, err
    assert b"%|" not in err and b"\r" not in err and b"%|" not in out
    assert b"[calibrate 1/" in out  # its own progress lines stay

    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal of 100 columns
    shown = _calibrate(tmp_path, secondary)
    os.close(secondary)
    seen = b""
    while True:
        try:
            chunk = os.read(primary, 1 << 16)
        except OSError:  # the terminal closed with the process
            break
        if not chunk:
            break
        seen += chunk
    shown.communicate(timeout=300)
    os.close(primary)
    assert shown.returncode == 0
    assert b"calibrate:" in seen and b"%|" in seen and b"point" in seen
    assert b"[calibrate 1/" not in seen  # the lines stay on stdout


def test_every_timeline_span_is_a_profiler_range(tmp_path):
    timeline = StepTimeline(str(tmp_path / "rank0.jsonl"), rank=0, world_size=1, clock_offset=0.0, threads=1)

    class Output:
        sample_ids = torch.arange(2)
        uih_lengths = torch.tensor([1, 2])

    with torch.profiler.profile() as prof:
        timeline.begin_step(1)
        with timeline.span("forward"):
            with timeline.span("exclusive_wait"):
                torch.ones(4).sum()
        timeline.open("backward")  # left open: it ends with the step
        with timeline.device_span("exclusive_send", None):
            pass
        timeline.end_step(1, Output())
    names = {e.name for e in prof.events()}
    assert {"freescale.forward", "freescale.exclusive_wait", "freescale.backward", "freescale.exclusive_send"} <= names
