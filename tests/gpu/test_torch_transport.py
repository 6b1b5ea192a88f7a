"""``host_staged`` over CUDA tensors against gloo's collectives on the same bytes, 2 ranks
sharing the GPU (gloo: NCCL refuses two ranks on one device).

The ordering is made visible as in ``test_torch_streams.py``: each rank's stream is held busy
before it writes the input, so a staging copy that did not wait for it would send the old
bytes, and the lane's copy-to-device stream is held before the result is waited for, so a
caller that read the result without waiting for the copy's event would see the buffer before
the copy. A high-lane collective must also complete while a normal one's staging copy still
waits behind its stream: the runner never blocks on a copy.

Torch tier of the GPU check: torch and FreeScale's torch-only modules.
"""

import time

import pytest
import torch
import torch.distributed as dist

from freescale.config import TransportConfig
from freescale.device import CopyEngine
from freescale.transport.base import HIGH, NORMAL
from freescale.transport.host_staged import HostStagedTransport
from helpers.cuda import HOLD_CYCLES, hold
from helpers.spawn import run_ranks

pytestmark = pytest.mark.gpu


def _transport():
    torch.cuda.set_device(0)  # both ranks share the one GPU
    return HostStagedTransport(dist.group.WORLD, TransportConfig(kind="host_staged", timeout_s=60), lanes=2)


def _written_after_a_hold(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` on the GPU, written by the current stream only after a long kernel."""
    x = torch.zeros_like(rows, device="cuda")
    source = rows.cuda()
    torch.cuda.synchronize()
    hold()
    x.copy_(source)
    return x


def _result_read_at_once(transport, handle, device, high: bool) -> torch.Tensor:
    """Wait for ``handle`` while the lane's copy-to-device stream is held, and read the result
    on the current stream at once (a copy of it, so the read is what is checked)."""
    hold(transport.staging.engine(device).streams[(CopyEngine.TO_DEVICE, high)])
    got = handle.wait()
    assert got.is_cuda
    return got.clone().cpu()


def _against_gloo(rank, world):
    t = _transport()
    try:
        splits = ([3, 5], [2, 7])  # what each rank sends each rank
        ins, outs = splits[rank], [s[rank] for s in splits]
        for lane in (NORMAL, HIGH):
            rows = torch.randn(sum(ins), 8, generator=torch.Generator().manual_seed(10 * rank + lane))
            x = _written_after_a_hold(rows)
            handle = t.all_to_all_single(x, ins, outs, lane=lane)
            got = _result_read_at_once(t, handle, x.device, high=lane == HIGH)
            want = torch.empty(sum(outs), 8)
            dist.all_to_all_single(want, rows, outs, ins)
            assert torch.equal(got, want), lane
        rows = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        x = _written_after_a_hold(rows)
        gathered = _result_read_at_once(t, t.all_gather(x), x.device, high=False)
        ref = [torch.empty(4, 8) for _ in range(world)]
        dist.all_gather(ref, rows)
        assert torch.equal(gathered, torch.cat(ref))
    finally:
        t.close()


def test_host_staged_moves_device_tensors_like_the_gloo_collective_on_both_lanes():
    run_ranks(2, _against_gloo)


def _high_passes_a_waiting_copy(rank, world):
    t = _transport()
    try:
        big = torch.arange(1 << 20, dtype=torch.float32, device="cuda") + rank * 1e7
        small = torch.tensor([rank * 10.0 + j for j in range(world)], device="cuda")
        splits, ones = [big.numel() // world] * world, [1] * world
        compute, other = torch.cuda.current_stream(), torch.cuda.Stream()
        torch.cuda.synchronize()
        dist.barrier()  # both ranks past their CUDA set-up: what follows takes well under the hold
        if rank == 0:
            hold(cycles=10 * HOLD_CYCLES)  # ~1 s: the normal one's staging copy waits behind it
        normal = t.all_to_all_single(big, splits, splits)
        time.sleep(0.1)  # the proxy has taken it by now
        with torch.cuda.stream(other):  # a stream that is free: the high one's copy need not wait
            high = t.all_to_all_single(small, ones, ones, lane=HIGH)
            got_high = high.wait().cpu()
        if rank == 0:
            assert not compute.query()  # the high one completed while the normal one's copy still waited
        got_normal = normal.wait().cpu()
        ref_high, ref_normal = torch.empty(world), torch.empty(big.numel())
        dist.all_to_all_single(ref_high, small.cpu())
        dist.all_to_all_single(ref_normal, big.cpu())
        assert torch.equal(got_high, ref_high) and torch.equal(got_normal, ref_normal)
    finally:
        t.close()


def test_a_high_lane_collective_passes_a_normal_one_whose_staging_copy_waits_behind_its_stream():
    run_ranks(2, _high_passes_a_waiting_copy)
