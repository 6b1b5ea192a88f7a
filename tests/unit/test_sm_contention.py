"""The copy benchmark's GPU section on CPU: its copies are sized to outlast the GEMM loop, a run
whose copies ended first is measured again with more, and the result says whether every run
was covered. A fake device times the runs: the loop takes ``loop_ms`` alone and longer beside
copies, each copy ``copy_ms`` alone and longer beside the loop."""

import pytest

from freescale.transport.sm_contention import COVER, TRIES, copies_to_cover, covered, measure, summarize


class FakeGpu:
    """Runs timed from the copies' start: the loop starts with them; beside copies it takes
    ``loop_slowdown`` times as long, and each copy ``copy_slowdown`` times as long."""

    def __init__(self, loop_ms, copy_ms, loop_slowdown, copy_slowdown):
        self.loop_ms, self.copy_ms = loop_ms, copy_ms
        self.loop_slowdown, self.copy_slowdown = loop_slowdown, copy_slowdown
        self.asked = []

    def timed(self, name, copies):
        self.asked.append((name, copies))
        loop = self.loop_ms * (1.0 if name == "alone" else self.loop_slowdown[name])
        span = copies * self.copy_ms.get(name, 0.0) * self.copy_slowdown
        return {"gemm_ms": loop, "copy_ms": span, "copies": copies, "copies_before_ms": 0.0,
                "copies_after_ms": span - loop}


def test_copies_are_sized_to_outlast_the_loop_that_24_sm_copies_do_not():
    # An H100: 20 GEMMs of 8192^2 in bf16 take ~28 ms; an SM copy of 512 MiB ~0.35 ms.
    assert 24 * 0.35 < 28.0  # what the benchmark queued before: over in a third of the loop
    n = copies_to_cover(28.0, 0.35)
    assert n * 0.35 >= COVER * 28.0
    assert copies_to_cover(28.0, 60.0) == 2  # a copy-engine copy longer than the loop
    assert copies_to_cover(28.0, 0.0) > 0


def test_every_run_covers_its_loop_and_the_result_reports_both_spans():
    gpu = FakeGpu(28.0, {"sm_copy": 0.35, "copy_engine": 12.0}, {"sm_copy": 1.6, "copy_engine": 1.02}, 1.3)
    runs = measure(gpu.timed, gpu.copy_ms, loop_ms=28.0, repeats=3)
    assert [name for name, _ in gpu.asked] == ["alone", "sm_copy", "copy_engine"] * 3  # taking turns
    for name in ("sm_copy", "copy_engine"):
        assert len(runs[name]) == 3
        assert all(covered(r) and r["copy_ms"] >= r["gemm_ms"] for r in runs[name])
    result = summarize(runs)
    assert result["covered"]
    assert result["sm_copy_slowdown_pct"]["mean"] == pytest.approx(60.0)
    assert result["copy_engine_slowdown_pct"]["mean"] == pytest.approx(2.0)


def test_a_run_whose_copies_ended_first_is_measured_again_with_twice_as_many():
    # The loop slows down 4x beside the copies: copies for 3x the loop alone end first.
    gpu = FakeGpu(28.0, {"sm_copy": 0.35}, {"sm_copy": 4.0}, 1.0)
    runs = measure(gpu.timed, gpu.copy_ms, loop_ms=28.0, repeats=2)
    first = copies_to_cover(28.0, 0.35)
    asked = [count for name, count in gpu.asked if name == "sm_copy"]
    assert asked[:2] == [first, 2 * first]
    assert asked[-1] == asked[-2]  # later repeats keep the count that covered
    assert all(covered(r) for r in runs["sm_copy"]) and summarize(runs)["covered"]


def test_a_variant_that_never_covers_its_loop_is_reported():
    gpu = FakeGpu(28.0, {"sm_copy": 0.35}, {"sm_copy": 100.0}, 1.0)
    runs = measure(gpu.timed, gpu.copy_ms, loop_ms=28.0, repeats=1)
    assert len([1 for name, _ in gpu.asked if name == "sm_copy"]) == TRIES
    assert not summarize(runs)["covered"]
