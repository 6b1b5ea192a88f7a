"""The timeline's device spans on a CUDA GPU: a step timed by CUDA events, a span on a side
stream timed on that stream (it covers the side stream's work, not the compute stream's), and
a step whose side-stream span outlasts its last event written only once that span is over.

Torch tier of the GPU check: torch and FreeScale's torch-only modules.
"""

import json

import pytest
import torch

from freescale.profile.timeline import DeviceClock, StepTimeline
from helpers.cuda import hold

pytestmark = pytest.mark.gpu


class _Output:
    sample_ids = torch.arange(4)
    uih_lengths = torch.tensor([1, 2, 3, 4])


def _records(path):
    return [json.loads(line) for line in open(path) if '"step"' in line]


def test_a_step_on_the_gpu_is_timed_by_cuda_events(tmp_path):
    path = tmp_path / "rank0.jsonl"
    timeline = StepTimeline(str(path), rank=0, world_size=1, clock_offset=0.0, threads=1,
                            device_clock=DeviceClock("cuda"))
    a = torch.randn(4096, 4096, device="cuda")
    for step in (1, 2):
        timeline.begin_step(step)
        with timeline.span("forward"):
            for _ in range(10):
                a = (a @ a).tanh()
        with timeline.span("exclusive_wait"):
            torch.cuda._sleep(1_000_000)  # the stream stalls, as when it waits for rows
        timeline.end_step(step, _Output())
    timeline.finish()
    records = _records(path)
    assert [r["step"] for r in records] == [1, 2]
    for rec in records:
        spans = {k: e - s for k, s, e in rec["device_spans"]}
        assert rec["device_compute"] == pytest.approx(spans["forward"], rel=1e-6)
        assert 0 < rec["device_compute"] < rec["device_step"]
        assert spans["exclusive_wait"] > 0


def test_a_side_stream_span_is_timed_on_that_stream_and_its_step_waits_for_it(tmp_path):
    path = tmp_path / "rank0.jsonl"
    timeline = StepTimeline(str(path), rank=0, world_size=1, clock_offset=0.0, threads=1,
                            device_clock=DeviceClock("cuda"))
    side = torch.cuda.Stream()
    inside = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
    timeline.begin_step(1)
    with timeline.span("forward"):
        torch.randn(256, 256, device="cuda").sum()
    with timeline.device_span("deferred_send", side):
        inside[0].record(side)
        hold(side)  # the side stream's work: it outlasts everything on the compute stream
        inside[1].record(side)
    timeline.end_step(1, _Output())
    torch.cuda.current_stream().synchronize()  # the step's last event is in; the side stream is still busy
    timeline.begin_step(2)
    timeline.end_step(2, _Output())  # writes what has completed
    timeline._file.flush()
    assert not side.query()
    assert _records(path) == []  # step 1 waits for its side-stream span
    timeline.finish()
    first, _ = _records(path)
    (span,) = [e - s for k, s, e in first["device_spans"] if k == "deferred_send"]
    # The span's events are on the side stream around its work: at least as long as that work.
    assert span >= inside[0].elapsed_time(inside[1]) / 1000.0 - 1e-6
    assert first["device_compute"] < span  # a side stream's exchange is not compute
