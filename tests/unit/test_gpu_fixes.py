"""What a first CUDA run would hit, checked through CPU seams: devices other than the CPU are
played by ``meta`` tensors, fake process groups and works, and fake events."""

import datetime
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from freescale.data.batch import HOST_FIELDS, Batch, Samples
from freescale.device import to_device
from freescale.distributed import group_backend
from freescale.embedding.exchange import ShardedTables
from freescale.profile.timeline import DeviceClock, StepTimeline
from freescale.train.trainer import StepWindow
from freescale.transport import torch_dist
from freescale.transport.torch_dist import TorchDistTransport, sliced_wait_is_safe


def test_the_log_line_sums_the_losses_on_their_own_device():
    # Losses on a device (meta here), the step and sample counts from the host: one tensor on the
    # losses' device, which the group reduces where it is.
    # The training FLOPs, counted on the host from the steps' lengths, travel in the same tensor.
    window = StepWindow()
    window.add(torch.tensor(0.5, device="meta"), 3, 1e6)
    window.add(torch.tensor(0.25, device="meta"), 4, 2e6)
    assert window.totals().device.type == "meta" and window.totals().shape == (4,)
    window = StepWindow()
    window.add(torch.tensor(0.5), 3, 1e6)
    window.add(torch.tensor(0.25), 4, 2e6)
    assert window.totals().tolist() == [0.75, 2.0, 7.0, 3e6] and window.totals().dtype == torch.float64


def test_a_gpu_jobs_group_carries_host_tensors_on_gloo_beside_nccl():
    assert group_backend(torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"
    assert group_backend(torch.device("cuda", 0), "nccl") == "cpu:gloo,cuda:nccl"
    assert group_backend(torch.device("cuda", 0), "gloo") == "gloo"
    assert group_backend(torch.device("cpu")) == "gloo"


class _Backend:
    def __init__(self, name):
        self._name = name

    def name(self):
        return self._name


class _Group:
    """A process group whose CUDA tensors go to NCCL and host tensors to gloo."""

    def _get_backend(self, device):
        return _Backend({"cuda": "nccl", "cpu": "gloo"}[device.type])


class NcclLikeWork:
    """A work with NCCL's wait semantics: ``wait(timeout)`` measures from the enqueue and, past
    it, aborts the communicator and raises; ``wait()`` orders the stream and returns."""

    def __init__(self):
        self.enqueued = time.monotonic()
        self.aborted = False

    def wait(self, timeout=None):
        if timeout is not None and time.monotonic() - self.enqueued > timeout.total_seconds():
            self.aborted = True
            raise RuntimeError("Watchdog caught collective operation timeout: the communicator is aborted")
        return True

    def is_completed(self):
        return True


@pytest.fixture
def one_rank_group():
    """A one-rank gloo group (the one an earlier test of this process left, if it did)."""
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_torch_dist_waits_for_nccl_work_without_a_timeout(one_rank_group):
    # NCCL's work on device tensors: one wait, no timeout (a timed wait a step after the issue
    # would abort the lane); gloo's: in slices, so that abort() releases a waiter.
    assert not sliced_wait_is_safe(_Group(), torch.device("cuda", 0))
    assert sliced_wait_is_safe(_Group(), torch.device("cpu"))
    assert sliced_wait_is_safe(one_rank_group, torch.device("cpu"))
    transport = TorchDistTransport(one_rank_group)
    work = NcclLikeWork()
    handle = torch_dist._WorkHandle(transport, "all_to_all_single", work, lambda: "rows",
                                    sliced_wait_is_safe(_Group(), torch.device("cuda", 0)))
    time.sleep(2 * torch_dist._SLICE.total_seconds())  # the wait comes later than a slice after the issue
    assert handle.wait() == "rows" and not work.aborted
    assert transport.errored() is None
    transport.close()


class _Event:
    """A fake event on a named stream whose completion the test sets per stream."""

    def __init__(self, clock):
        self.clock, self.stream, self.t = clock, None, None

    def record(self, stream=None):
        self.stream, self.t = stream or "compute", self.clock.now

    def query(self):
        return self.clock.done[self.stream]

    def synchronize(self):
        if not self.clock.done[self.stream]:
            self.clock.done[self.stream] = True

    def elapsed_time(self, other):
        assert self.query() and other.query(), "elapsed_time on an event that has not completed"
        return 1000.0 * (other.t - self.t)


class _Clock:
    def __init__(self):
        self.now = 0.0
        self.done = {"compute": False, "side": False}

    def event(self):
        return _Event(self)


class _Output:
    sample_ids = torch.arange(2)
    uih_lengths = torch.tensor([1, 2])


def _records(path):
    import json
    return [json.loads(line) for line in open(path) if '"step"' in line]


def test_a_step_record_waits_for_its_side_stream_events_too(tmp_path):
    clock = _Clock()
    path = tmp_path / "rank0.jsonl"
    timeline = StepTimeline(str(path), rank=0, world_size=1, clock_offset=0.0, threads=1,
                            device_clock=DeviceClock("cpu", new_event=clock.event))
    timeline.begin_step(1)
    with timeline.span("forward"):
        clock.now = 0.01
    with timeline.device_span("exclusive_send", "side"):  # issued in step 1, done after its last kernel
        clock.now = 0.02
    timeline.end_step(1, _Output())
    clock.done["compute"] = True
    timeline.begin_step(2)
    timeline.end_step(2, _Output())  # asks again: the side stream is not done, nothing is written
    timeline._file.flush()
    assert _records(path) == []
    clock.done["side"] = True
    timeline.begin_step(3)
    timeline.end_step(3, _Output())
    timeline._file.flush()
    assert [r["step"] for r in _records(path)] == [1, 2, 3]
    timeline.finish()


def test_a_lookup_of_no_ids_launches_no_kernel():
    tables = ShardedTables({"items": 10}, 4, rank=0, world_size=1, group=None, optimizer="rowwise_adagrad", lr=0.1,
                           init_std=0.1, seed=0)

    def refuse(*args):
        raise AssertionError("the kernel ran over no ids")

    tables.kernel.forward = refuse
    for track in (False, True):
        rows = tables.lookup(torch.zeros(0, dtype=torch.int64), track=track)
        assert rows.shape == (0, 4)
    tables.update(torch.zeros(0, dtype=torch.int64), torch.zeros(0, 4))


def _batch():
    n = 3
    samples = Samples(sample_ids=np.arange(n), user_ids=np.arange(n), uih_lengths=np.array([2, 0, 1]),
                      uih_values=np.array([5, 6, 7]), uih_timestamps=np.array([100, 160, 90]),
                      cand_counts=np.array([1, 2, 1]), cand_values=np.array([1, 2, 3, 4]),
                      cand_timestamps=np.array([200, 300, 300, 400]), labels=np.array([[1], [0], [1], [0]], dtype=np.float32))
    return Batch.from_samples(samples, batch_index=4, user_hash_size=10)


@pytest.fixture
def copies(monkeypatch):
    """Host-to-device copies as (from pinned memory, non-blocking); meta plays the device, and
    since pinning needs a real one, pinned memory is played by a marked clone."""
    made = []

    def pin_memory(self):
        out = self.clone()
        out._pinned = True
        return out

    to = torch.Tensor.to

    def recording_to(self, *args, **kwargs):
        made.append((getattr(self, "_pinned", False), kwargs.get("non_blocking")))
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: getattr(self, "_pinned", False))
    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    return made


def test_a_batch_goes_to_a_device_from_pinned_memory_and_keeps_its_shape_on_the_host(copies):
    batch = _batch()
    batch.seen_items = [np.arange(3)] * len(batch)  # (held-out retrieval's: arrays, not tensors)
    moved = batch.to(torch.device("meta"), non_blocking=False)
    assert moved.labels.device.type == "meta" and moved.seq_features.values().device.type == "meta"
    assert copies and all(copy == (True, True) for copy in copies), copies  # pinned, non-blocking, always
    for name in HOST_FIELDS:
        if name == "seen_items":
            assert moved.seen_items is batch.seen_items
        else:
            assert getattr(moved, name).device.type == "cpu", name
    # The ids stay on the host too when the pipeline routes them from there.
    assert _batch().to(torch.device("meta"), sparse=False).seq_features.values().device.type == "cpu"


def test_evaluation_over_torchrecs_tables_moves_each_held_out_batch_to_the_device(copies):
    from freescale.train.pipelines import _TorchRecPipeline

    seen = []

    class Model(torch.nn.Module):
        def forward(self, batch):
            seen.append((batch.labels.device.type, batch.uih_lengths.device.type))
            return torch.zeros(()), None

    pipeline = _TorchRecPipeline(None, Model(), torch.device("meta"))
    with pipeline.evaluating() as model:
        model(_batch())  # held-out batches are read into host memory
    assert seen == [("meta", "cpu")]


def test_on_cpu_the_device_copy_is_an_alias():
    host = torch.arange(4)
    moved = to_device(host, "cpu")
    assert moved is not host and moved.data_ptr() == host.data_ptr()


_BLOCKED = '''
import importlib, sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torchrec", "fbgemm_gpu", "torchft"):
            raise ImportError(f"{name} is not installed here")
sys.meta_path.insert(0, Blocked())
# What the GPU check's torch tier runs of FreeScale: the dense model's forward and backward, a
# host_staged collective.
import datetime
import torch, torch.distributed as dist
from freescale.config import ModelConfig, TransportConfig
from freescale.model.seqrec import SeqRecTask
from freescale.transport.registry import build_transport
task = SeqRecTask(ModelConfig(embedding_dim=8, num_layers=1, num_heads=2, mlp_dims=[4], user_features=True), 16)
lengths, counts = torch.tensor([2, 0, 3]), torch.tensor([1, 2, 1])
loss, _ = task(torch.randn(5, 8), torch.randn(4, 8), torch.randn(3, 8), torch.zeros(9, dtype=torch.long), lengths,
               counts, torch.zeros(5, dtype=torch.long), torch.zeros(4, dtype=torch.long), torch.ones(4, 1),
               torch.arange(3), torch.tensor(0), torch.tensor(1.0))
loss.backward()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
transport = build_transport(TransportConfig(kind="host_staged"), dist.group.WORLD)
assert torch.equal(transport.all_to_all_single(torch.arange(4), [4], [4]).wait(), torch.arange(4))
transport.close()
dist.destroy_process_group()
print("torch tier ok:", sorted(m for m in sys.modules if m.split(".")[0] in ("torchrec", "fbgemm_gpu", "torchft")))
'''


def test_the_dense_model_and_host_staged_run_without_torchrec_fbgemm_or_torchft():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", _BLOCKED], cwd=root, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "torch tier ok: []" in proc.stdout, proc.stdout
