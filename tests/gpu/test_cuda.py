"""On a CUDA GPU: copy-engine staging without a kernel, side-stream ordering, FreeScale's own
tables on the device against the CPU kernel, ``host_staged`` over device tensors against gloo,
device-timed step records, and calibration on the device.

Every test here is marked ``gpu``; where torch sees no CUDA device each is skipped with the
reason (``tests/conftest.py``). ``scripts/gpu_check.sh`` runs them (``pytest -m gpu``).
"""

import pytest
import torch
import torch.distributed as dist

from freescale.config import load_config
from freescale.device import CopyEngine, Streams
from freescale.embedding.exchange import ShardedTables
from freescale.profile.timeline import DeviceClock, StepTimeline
from helpers.launch import QUICKSTART
from helpers.spawn import run_ranks

pytestmark = pytest.mark.gpu


def test_the_copy_engine_moves_a_device_tensor_to_pinned_memory_and_back_without_a_kernel():
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(1 << 20, device="cuda")
    engine = CopyEngine(x.device)
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.to_host(x, host).synchronize()
        back, done = engine.to_device(host, x.device)
        done.synchronize()
        torch.cuda.synchronize()
    assert torch.equal(host, x.cpu()) and torch.equal(back, x)
    on_device = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    assert any("memcpy" in n.lower() for n in on_device), on_device
    kernels = [n for n in on_device if "memcpy" not in n.lower() and "memset" not in n.lower()]
    assert kernels == [], kernels  # copies only: no streaming multiprocessor was used


def test_side_stream_work_reads_what_the_compute_stream_wrote_and_is_waited_for():
    streams = Streams("cuda")
    side = streams.side()
    a = torch.randn(4096, 4096, device="cuda")
    for k in range(3):
        x = a @ a  # long enough that an unordered reader would see the old values
        x.add_(k)
        with streams.on(side):
            y = x.sum(dim=0)
        y = streams.take(y, side)
        torch.testing.assert_close(y, x.sum(dim=0), rtol=0, atol=0)


def _tables(device):
    return ShardedTables({"item_table": 1000, "user_table": 50}, 16, rank=0, world_size=1, group=None,
                         optimizer="rowwise_adagrad", lr=0.1, init_std=0.02, seed=3, device=device)


def test_owned_tables_on_cuda_live_in_device_memory_and_train_like_the_cpu_kernel():
    cpu, gpu = _tables("cpu"), _tables("cuda")
    assert gpu.weight.is_cuda and gpu.momentum().is_cuda
    torch.testing.assert_close(gpu.weight.cpu(), cpu.weight, rtol=0, atol=0)  # the same rows, drawn on the host
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, 1050, (300,), generator=g)  # repeats sum, as in one step
        grads = torch.randn(300, 16, generator=g)
        torch.testing.assert_close(gpu.lookup(ids.cuda()).cpu(), cpu.lookup(ids), rtol=1e-6, atol=1e-7)
        cpu.update(ids, grads)
        gpu.update(ids.cuda(), grads.cuda())
    torch.testing.assert_close(gpu.weight.cpu(), cpu.weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gpu.momentum().cpu(), cpu.momentum(), rtol=1e-5, atol=1e-6)


def _staged_all_to_all(rank, world):
    from freescale.config import TransportConfig
    from freescale.transport.host_staged import HostStagedTransport

    torch.cuda.set_device(0)  # both ranks share the one GPU (gloo: NCCL refuses that)
    transport = HostStagedTransport(dist.group.WORLD, TransportConfig(kind="host_staged", timeout_s=60), lanes=2)
    try:
        splits = ([3, 5], [2, 7])  # what each rank sends each rank
        ins, outs = splits[rank], [s[rank] for s in splits]
        rows = torch.randn(sum(ins), 8, generator=torch.Generator().manual_seed(rank))
        got = transport.all_to_all_single(rows.cuda(), ins, outs).wait()
        want = torch.empty(sum(outs), 8)
        dist.all_to_all_single(want, rows, outs, ins)
        assert got.is_cuda and torch.equal(got.cpu(), want)
        gathered = transport.all_gather(rows[:4].cuda()).wait()
        ref = [torch.empty(4, 8) for _ in range(world)]
        dist.all_gather(ref, rows[:4])
        assert gathered.is_cuda and torch.equal(gathered.cpu(), torch.cat(ref))
    finally:
        transport.close()


def test_host_staged_moves_device_tensors_like_the_gloo_collective_on_two_ranks_sharing_the_gpu():
    run_ranks(2, _staged_all_to_all)


class _Output:
    sample_ids = torch.arange(4)
    uih_lengths = torch.tensor([1, 2, 3, 4])


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
    import json

    records = [json.loads(line) for line in open(path) if '"step"' in line]
    assert [r["step"] for r in records] == [1, 2]
    for rec in records:
        spans = {k: e - s for k, s, e in rec["device_spans"]}
        assert rec["device_compute"] == pytest.approx(spans["forward"], rel=1e-6)
        assert 0 < rec["device_compute"] < rec["device_step"]
        assert spans["exclusive_wait"] > 0


def test_calibration_times_the_model_on_the_gpu():
    from freescale.balance.calibrate import calibrate

    cfg = load_config(QUICKSTART, ["--run.device=cuda", "--data.max_uih_len=64", "--model.num_layers=1"])
    model = calibrate(cfg, repeats=1, log=lambda *_: None)
    assert model.fit["device"] == "cuda"
    assert all(seconds > 0 for _, _, seconds in model.fit["grid"])
