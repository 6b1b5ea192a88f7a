"""scripts/bench_transport.py's table cells over repeated runs."""

import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("bench_transport", os.path.join(REPO, "scripts", "bench_transport.py"))
bt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bt)


def test_a_cell_is_the_median_run_and_the_range_over_the_runs():
    assert bt.spread([2.41], "{:.2f}", "x") == "2.41x"
    assert bt.spread([2.54, 2.33, 2.41], "{:.2f}", "x") == "2.41x (2.33-2.54)"
    assert bt.spread([1.0, 3.0], "{:.1f}") == "2.0 (1.0-3.0)"  # (an even count: the mean of the middle two)
