import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import file_order  # noqa: E402  (after the path above)


_SECONDS: dict[str, dict[str, float]] = {}  # "recording": seconds per file, under --record-durations


def pytest_addoption(parser):
    parser.addoption("--record-durations", action="store_true",
                     help="write the seconds each test file took into tests/file_durations.json "
                          "(the order the files run in: slowest first)")


def pytest_configure(config):
    # The files' order is the collection's (slowest first, below), not pytest-xdist's (most tests first).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if config.getoption("record_durations") and not hasattr(config, "workerinput"):  # (the controller sees every report)
        _SECONDS.clear()
        _SECONDS["recording"] = {}


def _no_gpu_reason() -> str | None:
    """Why the ``gpu`` tests cannot run here (None: they can)."""
    if torch.version.cuda is None:
        return f"needs a CUDA GPU: torch {torch.__version__} is a CPU build"
    if not torch.cuda.is_available():
        return f"needs a CUDA GPU: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no device"
    return None


def pytest_collection_modifyitems(config, items):
    order = file_order.slowest_first([item.nodeid for item in items], file_order.read_record())
    items[:] = [items[i] for i in order]
    reason = _no_gpu_reason()
    if reason is None:
        return
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_runtest_logreport(report):
    seconds = _SECONDS.get("recording")
    if seconds is not None:
        f = file_order.file_of(report.nodeid)
        seconds[f] = seconds.get(f, 0.0) + report.duration


def pytest_sessionfinish(session):
    seconds = _SECONDS.get("recording")
    if seconds:
        file_order.write_record(seconds)
