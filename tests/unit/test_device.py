"""The device-generic parts, on CPU: where the tables live, what is staged, device-timed step
records (events from a fake clock) and the bubble decomposition over them, calibration on the
run's device, and the set-up script's choice of builds. The GPU check's script:
``test_gpu_check.py``."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, EmbeddingLocation

from freescale.config import load_config
from freescale.embedding.exchange import placement
from freescale.profile.bubbles import decompose
from freescale.profile.timeline import DeviceClock, StepTimeline
from freescale.transport.host_staged.staging import needs_staging
from helpers.launch import QUICKSTART

ROOT = Path(__file__).resolve().parents[2]


def test_tables_are_placed_in_host_memory_on_cpu_and_in_device_memory_on_cuda():
    assert placement(torch.device("cpu")) == (EmbeddingLocation.HOST, ComputeDevice.CPU)
    assert placement(torch.device("cuda", 0)) == (EmbeddingLocation.DEVICE, ComputeDevice.CUDA)
    with pytest.raises(ValueError, match="cpu or cuda, not meta"):
        placement(torch.device("meta"))


def test_only_device_tensors_are_staged_through_host_memory():
    assert not needs_staging(torch.zeros(3))
    assert needs_staging(torch.zeros(3, device="meta"))


class FakeDevice:
    """A device clock the test moves by hand; its events complete when ``done`` says so."""

    def __init__(self):
        self.now = 0.0
        self.done = False

    def event(self):
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, device):
        self.device = device
        self.t = None

    def record(self, stream=None):
        self.t = self.device.now

    def query(self):
        return self.device.done

    def synchronize(self):
        self.device.done = True

    def elapsed_time(self, other):
        return 1000.0 * (other.t - self.t)


class StreamEvent(FakeEvent):
    """An event that completes once its stream has reached it (``reached[stream]``, default
    True); like CUDA's, its elapsed time needs both events complete."""

    def __init__(self, device, reached):
        super().__init__(device)
        self.reached = reached
        self.stream = None

    def record(self, stream=None):
        self.stream = stream
        super().record(stream)

    def query(self):
        return self.reached.get(self.stream, True)

    def synchronize(self):
        self.reached[self.stream] = True

    def elapsed_time(self, other):
        assert self.query() and other.query(), "cudaErrorNotReady: an event has not completed"
        return super().elapsed_time(other)


class Output:
    sample_ids = torch.arange(4)
    uih_lengths = torch.tensor([3, 1, 2, 2])


def _step(timeline, fake, step, at):
    """One step on the fake device from ``at`` s: forward 50 ms with a 20 ms wait for rows in it,
    backward 40 ms, optimizer 10 ms, 20 ms more to the step's last event."""
    def at_(t):
        fake.now = at + t
    at_(0.0)
    timeline.begin_step(step)
    timeline.open("forward")
    at_(0.010)
    timeline.open("exclusive_wait")
    at_(0.030)
    timeline.close("exclusive_wait")
    at_(0.050)
    timeline.close("forward")
    timeline.open("backward")
    at_(0.090)
    timeline.close("backward")
    timeline.open("optimizer")
    at_(0.100)
    timeline.close("optimizer")
    at_(0.120)
    timeline.end_step(step, Output())


def _records(path):
    return [json.loads(line) for line in open(path) if "step" in json.loads(line)]


def test_device_timed_steps_count_compute_from_events_and_are_written_once_the_device_is_done(tmp_path):
    fake = FakeDevice()
    path = tmp_path / "profile" / "rank0.jsonl"
    timeline = StepTimeline(str(path), rank=0, world_size=1, clock_offset=0.0, threads=1,
                            device_clock=DeviceClock("cpu", new_event=fake.event))
    _step(timeline, fake, 1, 0.0)
    _step(timeline, fake, 2, 0.2)
    timeline._file.flush()
    assert _records(path) == []  # the device has not reached the steps' last events: nothing waited for
    fake.done = True
    _step(timeline, fake, 3, 0.4)
    timeline._file.flush()
    assert [r["step"] for r in _records(path)] == [1, 2, 3]  # in order, once complete
    fake.done = False
    _step(timeline, fake, 4, 0.6)
    timeline.finish()  # the end waits for the device
    records = _records(path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for rec in records:
        # forward 50 - wait 20, backward 40, optimizer 10: 80 ms of the device's own compute
        assert rec["device_compute"] == pytest.approx(0.080)
        assert rec["device_step"] == pytest.approx(0.120)
        kinds = {k: (round(e - s, 6), round(s - rec["start"], 6)) for k, s, e in rec["device_spans"]}
        assert kinds == {"forward": (0.05, 0.0), "exclusive_wait": (0.02, 0.01), "backward": (0.04, 0.05),
                         "optimizer": (0.01, 0.09)}


def test_a_device_span_on_a_side_stream_is_recorded_on_that_stream(tmp_path):
    fake, streams = FakeDevice(), []

    class Marking(FakeEvent):
        def record(self, stream=None):
            streams.append(stream)
            super().record(stream)

    timeline = StepTimeline(str(tmp_path / "rank0.jsonl"), rank=0, world_size=1, clock_offset=0.0, threads=1,
                            device_clock=DeviceClock("cpu", new_event=lambda: Marking(fake)))
    timeline.begin_step(1)
    fake.now = 0.01
    with timeline.device_span("exclusive_send", "side"):
        fake.now = 0.03
    fake.done = True
    timeline.end_step(1, Output())
    timeline.finish()
    (rec,) = _records(tmp_path / "rank0.jsonl")
    assert streams == [None, "side", "side", None]
    (span,) = rec["device_spans"]
    assert span[0] == "exclusive_send" and span[2] - span[1] == pytest.approx(0.02)
    assert rec["device_compute"] == 0.0  # a side stream's exchange is not compute


def test_a_step_is_written_once_its_side_stream_spans_have_completed_too(tmp_path):
    # The side stream's exchange outlasts the step's last event on the compute stream.
    fake, reached = FakeDevice(), {"side": False}
    path = tmp_path / "rank0.jsonl"
    timeline = StepTimeline(str(path), rank=0, world_size=1, clock_offset=0.0, threads=1,
                            device_clock=DeviceClock("cpu", new_event=lambda: StreamEvent(fake, reached)))

    def step(n, at):
        fake.now = at
        timeline.begin_step(n)
        with timeline.device_span("deferred_send", "side"):
            fake.now = at + 0.05
        fake.now = at + 0.01
        timeline.end_step(n, Output())

    step(1, 0.0)
    timeline._file.flush()
    assert _records(path) == []  # its last event is in, the side stream's span is not
    reached["side"] = True
    step(2, 0.1)
    timeline._file.flush()
    assert [r["step"] for r in _records(path)] == [1, 2]
    reached["side"] = False
    step(3, 0.2)
    timeline.finish()  # the end waits for the side stream too
    records = _records(path)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["device_spans"][0][2] - r["device_spans"][0][1] == pytest.approx(0.05) for r in records)


def _record(step, start, end, cpu, device_compute=None, device_step=None):
    rec = {"step": step, "start": start, "end": end, "cpu": cpu, "data_cpu": 0.0, "spans": []}
    if device_compute is not None:
        rec.update(device_compute=device_compute, device_step=device_step, device_spans=[])
    return rec


def test_the_bubble_decomposition_takes_compute_from_the_device_when_the_step_was_device_timed():
    # Host: both ranks' threads busy 90 ms of the 100 (launching kernels); device: rank 1 computed
    # 60 ms, rank 0 30 ms, and rank 0's device step ran 110 ms.
    steps = {0: [_record(1, 0.0, 0.100, 0.090, device_compute=0.030, device_step=0.110)],
             1: [_record(1, 0.0, 0.100, 0.090, device_compute=0.060, device_step=0.100)]}
    r0, r1 = decompose(steps)
    assert r0.C == pytest.approx(0.030) and r1.C == pytest.approx(0.060)
    assert r0.T == pytest.approx(0.110)  # the device's step when it outlasts the host's
    assert r0.straggler == pytest.approx(0.030)  # rank 1's compute ends 30 ms after rank 0's
    host = decompose({0: [_record(1, 0.0, 0.100, 0.090)], 1: [_record(1, 0.0, 0.100, 0.090)]})
    assert [s.C for s in host] == pytest.approx([0.090, 0.090])  # CPU runs: the main thread's CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_calibration_times_the_model_on_the_runs_device():
    from freescale.balance.calibrate import calibrate

    cfg = load_config(QUICKSTART, ["--run.device=cuda"])
    with pytest.raises(RuntimeError, match="run.device is cuda but no CUDA device"):
        calibrate(cfg, repeats=1, log=lambda *_: None)


def _setup_plan(tmp_path, gpu: bool) -> str:
    bin_dir = tmp_path / ("gpu" if gpu else "cpu")
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 (UUID: GPU-0)'\n" if gpu else "#!/bin/sh\nexit 9\n")
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FREESCALE_VENV": str(tmp_path / "venv")}
    proc = subprocess.run([str(ROOT / "scripts" / "setup.sh"), "--plan"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_setup_installs_the_cuda_builds_where_nvidia_smi_answers_and_the_cpu_builds_elsewhere(tmp_path):
    gpu, cpu = _setup_plan(tmp_path, gpu=True), _setup_plan(tmp_path, gpu=False)
    assert "fbgemm-gpu==1.8.0" in gpu.split() and "fbgemm-gpu-cpu==1.8.0" not in gpu
    assert "fbgemm-gpu-cpu==1.8.0" in cpu.split() and "fbgemm-gpu==1.8.0" not in cpu.split()
    assert "torch==2.13.0" in gpu and "torch==2.13.0" in cpu
    assert "build: cuda" in gpu and "build: cpu" in cpu
    assert not (tmp_path / "venv").exists()  # a plan installs nothing


def test_the_report_says_where_compute_was_read_from(tmp_path):
    from freescale.profile.report import analyze

    for name, device in (("gpu", True), ("cpu", False)):
        folder = tmp_path / name / "profile"
        folder.mkdir(parents=True)
        for rank in (0, 1):
            recs = [_record(s, s * 0.1, s * 0.1 + 0.1, 0.09, *((0.05, 0.1) if device else ())) for s in (1, 2, 3)]
            lines = [{"meta": {"rank": rank, "world_size": 2}}, *recs]
            (folder / f"rank{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        summary = analyze(str(tmp_path / name), warmup_steps=0)["summary"]
        assert summary["compute_from"] == ("device events" if device else "main-thread CPU")
        assert summary["compute_ms_per_step"] == (50.0 if device else 90.0)
