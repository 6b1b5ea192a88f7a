"""The step timeline's measure of a rank's wait for a core (``cpu_wait``), on a core made busy."""

import json
import os

import pytest
import torch

from freescale.profile.straggler import spin
from freescale.profile.timeline import CpuWaitClock, StepTimeline
from helpers.busy import busy_core


class Output:
    sample_ids = torch.arange(2)
    uih_lengths = torch.tensor([1, 2])


def reports_run_delay() -> bool:
    clock = CpuWaitClock.open()
    if clock is not None:
        clock.close()
    return clock is not None


@pytest.mark.skipif(not reports_run_delay(), reason="this kernel keeps no run delay per thread (schedstat)")
def test_a_thread_sharing_its_core_with_a_cpu_bound_process_records_its_wait_for_it(tmp_path):
    # The recording thread shares a core with a CPU-bound process: spinning for a while of wall
    # time, it runs about half of it and waits for the core the other half.
    allowed = os.sched_getaffinity(0)
    with busy_core() as core:
        os.sched_setaffinity(0, core)
        try:
            timeline = StepTimeline(str(tmp_path / "rank0.jsonl"), rank=0, world_size=1, clock_offset=0.0, threads=1)

            def loader():
                while True:
                    spin(0.1)
                    yield None

            batches = timeline.timed_batches(loader())
            timeline.begin_step(1)
            next(batches)
            spin(0.2)
            timeline.end_step(1, Output())
            timeline.finish()
        finally:
            os.sched_setaffinity(0, allowed)
    record = json.loads((tmp_path / "rank0.jsonl").read_text().splitlines()[-1])
    wall = record["end"] - record["start"]
    assert record["cpu"] + record["cpu_wait"] == pytest.approx(wall, abs=0.03), record  # it never slept
    assert record["data_cpu_wait"] > 0.02 and record["cpu_wait"] - record["data_cpu_wait"] > 0.05, record


def test_a_traced_window_names_its_steps_as_training_numbers_them(tmp_path):
    trace = tmp_path / "trace.json"
    timeline = StepTimeline(str(tmp_path / "rank0.jsonl"), rank=0, world_size=1, clock_offset=0.0, threads=1,
                            trace_steps=[3, 4], trace_path=str(trace))
    for step in range(1, 6):
        timeline.begin_step(step)
        torch.ones(8).sum()
        timeline.end_step(step, Output())
    timeline.finish()
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {n for n in names if str(n).startswith("ProfilerStep#")} == {"ProfilerStep#3", "ProfilerStep#4"}
