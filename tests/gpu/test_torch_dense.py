"""On a CUDA GPU with torch alone (the GPU check's torch tier): the dense model trains as on the
CPU and its forward never makes the host wait for the device; the catch-up copy a peer takes of
its state lands in host memory holding every write issued before it.

Imports: torch, pytest and FreeScale's torch-only modules (no TorchRec, fbgemm or torchft).
"""

import threading

import pytest
import torch

from freescale.config import ModelConfig
from freescale.ft.catchup import transfer_state
from freescale.model.seqrec import SeqRecTask
from helpers.syncs import SyncCounter

pytestmark = pytest.mark.gpu

TOLERANCE = 1e-4  # loss and gradients, GPU against CPU
DIM = 16


def _task(device):
    torch.manual_seed(0)
    cfg = ModelConfig(embedding_dim=DIM, num_layers=2, num_heads=2, mlp_dims=[8], user_features=True,
                      attention_padding=1.25)
    return SeqRecTask(cfg, max_uih_len=32).to(device)


def _inputs(device):
    """A batch as the pipelines give it: rows and labels on ``device``, its shape on the host."""
    g = torch.Generator().manual_seed(1)
    uih_lengths = torch.tensor([3, 0, 17, 9, 1, 40, 5, 2])  # an empty history, one past the position table
    cand_counts = torch.tensor([2, 1, 3, 1, 2, 4, 1, 2])
    rows = [torch.randn(int(uih_lengths.sum()), DIM, generator=g), torch.randn(int(cand_counts.sum()), DIM, generator=g),
            torch.randn(len(uih_lengths), DIM, generator=g)]
    labels = (torch.rand(int(cand_counts.sum()), generator=g) < 0.5).float()
    leaves = [r.to(device).requires_grad_() for r in rows]
    return leaves, (*leaves, uih_lengths, cand_counts, labels.to(device), torch.arange(8), torch.tensor(0),
                    torch.tensor(1.0, device=device))


def test_the_dense_model_trains_on_the_gpu_as_on_the_cpu_and_its_forward_never_waits():
    cpu_leaves, cpu_args = _inputs("cpu")
    cpu_task = _task("cpu")
    cpu_loss, _ = cpu_task(*cpu_args)
    cpu_loss.backward()

    gpu_leaves, gpu_args = _inputs("cuda")
    gpu_task = _task("cuda")
    gpu_task(*gpu_args)  # a first forward warms the allocators (pinned blocks, cuBLAS handles)
    torch.cuda.synchronize()
    counter = SyncCounter(device="cuda")
    torch.cuda.set_sync_debug_mode("error")  # torch's own check: any synchronizing call raises
    try:
        with counter:
            gpu_loss, out = gpu_task(*gpu_args)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert counter.syncs == [], counter.syncs
    gpu_loss.backward()
    assert out.logits.is_cuda and out.uih_lengths.device.type == "cpu"
    assert abs(float(gpu_loss) - float(cpu_loss)) <= TOLERANCE
    for cpu_leaf, gpu_leaf in zip(cpu_leaves, gpu_leaves):
        assert float((gpu_leaf.grad.cpu() - cpu_leaf.grad).abs().max()) <= TOLERANCE
    for (name, p), q in zip(cpu_task.named_parameters(), gpu_task.parameters()):
        assert float((q.grad.cpu() - p.grad).abs().max()) <= TOLERANCE, name


def test_the_catch_up_copy_lands_in_host_memory_with_every_write_issued_before_it():
    state = {"rows": torch.zeros(1 << 20, device="cuda"), "step": 7}
    torch.cuda._sleep(50_000_000)  # tens of milliseconds on the device before the write below runs
    state["rows"].fill_(1.0)
    copy = {}
    # As torchft's quorum thread takes it, while the trainer's thread goes on.
    taker = threading.Thread(target=lambda: copy.update(transfer_state(state)))
    taker.start()
    taker.join()
    state["rows"].fill_(2.0)  # issued after the copy: not in it
    assert copy["rows"].device.type == "cpu" and copy["step"] == 7
    assert bool((copy["rows"] == 1.0).all())
    torch.cuda.synchronize()
    assert bool((state["rows"] == 2.0).all())
