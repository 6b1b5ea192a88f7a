"""MFU arithmetic and the bubble report's efficiency figures."""

from __future__ import annotations

import json

import pytest

from freescale.profile.mfu import measures, mfu
from freescale.profile.peak import PEAK_FILE
from freescale.profile.report import analyze


def test_mfu_is_flops_over_the_ranks_peak_capacity():
    assert mfu(3e9, 2.0, 1e9, 3) == pytest.approx(0.5)
    assert mfu(1e9, 1.0, 0.0, 2) == 0.0  # no peak: nothing to compare against
    m = measures(4e12, 8, 2.0, 1e12, 4)
    assert m == {"train/tflops(TFLOP/s)": 2.0, "train/mfu(%)": 50.0, "train/flop_per_sample": 5e11}


def _run(tmp_path, *, flops: bool = True, peak: float | None = 1e9):
    """Two ranks, three steps of 0.1 s (rank 1's third 0.2 s); step 1 is warm-up."""
    folder = tmp_path / "profile"
    folder.mkdir(parents=True)
    for rank in (0, 1):
        recs = []
        for step in (1, 2, 3):
            length = 0.2 if (rank, step) == (1, 3) else 0.1
            rec = {"step": step, "start": step, "end": step + length, "cpu": 0.05, "spans": [], "samples": 4 + rank,
                   "uih_tokens": 10}
            if flops:
                rec["train_flops"] = 1e7 * (step + rank)
            recs.append(rec)
        lines = [{"meta": {"rank": rank, "world_size": 2}}, *recs]
        (folder / f"rank{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    if peak is not None:
        (tmp_path / PEAK_FILE).write_text(json.dumps({"flop_per_s": peak}))
    return analyze(str(tmp_path), warmup_steps=1)["summary"]


def test_the_report_counts_the_recorded_steps_after_warmup(tmp_path):
    s = _run(tmp_path)
    flops = 1e7 * (2 + 3 + 3 + 4)  # steps 2 and 3 of ranks 0 and 1
    seconds = (0.1 + 0.1 + 0.1 + 0.2) / 2  # the steps' wall time, mean over the ranks
    assert s["train_flop_per_sample"] == pytest.approx(flops / (4 + 4 + 5 + 5))
    assert s["model_tflops"] == pytest.approx(flops / seconds / 1e12, rel=1e-4)
    assert s["mfu_pct"] == pytest.approx(100 * flops / (seconds * 1e9 * 2), rel=1e-4)
    assert s["peak_tflops_per_rank"] == pytest.approx(1e-3)


def test_without_a_peak_or_counted_flops_the_report_says_less(tmp_path):
    s = _run(tmp_path / "a", peak=None)
    assert "mfu_pct" not in s and s["train_flop_per_sample"] > 0
    s = _run(tmp_path / "b", flops=False)
    assert "mfu_pct" not in s and "train_flop_per_sample" not in s
