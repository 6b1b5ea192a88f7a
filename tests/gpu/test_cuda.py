"""On a CUDA GPU, what needs the full stack (fbgemm's kernels, the trainer's calibration):
FreeScale's own tables on the device against the CPU kernel, and calibration on the device.
What torch alone can check (streams, the copy engine, ``host_staged`` over device tensors, the
timeline's device spans) is in ``tests/gpu/test_torch_*.py``.

Every test here is marked ``gpu``; where torch sees no CUDA device each is skipped with the
reason (``tests/conftest.py``). ``scripts/gpu_check.sh --tier full`` runs them (``pytest -m gpu``).
"""

import pytest
import torch

from freescale.config import load_config
from freescale.embedding.exchange import ShardedTables
from helpers.launch import QUICKSTART

pytestmark = pytest.mark.gpu


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


def test_calibration_times_the_model_on_the_gpu():
    from freescale.balance.calibrate import calibrate

    cfg = load_config(QUICKSTART, ["--run.device=cuda", "--data.max_uih_len=64", "--model.num_layers=1"])
    model = calibrate(cfg, repeats=1, log=lambda *_: None)
    assert model.fit["device"] == "cuda"
    assert all(seconds > 0 for _, _, seconds in model.fit["grid"])
