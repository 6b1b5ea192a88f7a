"""The analytic FLOP count of the transformer task against torch's FlopCounterMode.

FlopCounterMode counts the matmuls a forward runs (mm, addmm, bmm and the attention kernels
it knows). On CPU, ``scaled_dot_product_attention`` dispatches to a fused kernel the counter
has no formula for (it would count 0), so these forwards run attention on the math backend,
whose bmm the counter sees. The counter leaves elementwise work out, as the analytic count
does: where no padding is run the two agree exactly. A batch of unequal lengths runs its
attention padded within each length group (histories to the group's longest, candidates to its
most); the counter then counts the padding too, and it must equal the analytic count plus
exactly that padding.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from freescale.config import ModelConfig
from freescale.model import flops as flops_module
from freescale.model.flops import attention, training_flops
from freescale.model.jagged_attention import group_by_length
from freescale.model.seqrec import SeqRecTask

MAX_LEN = 64


def _cfg(**kw) -> ModelConfig:
    base = dict(embedding_dim=16, d_model=24, num_layers=2, num_heads=2, ffn_mult=3, mlp_dims=[20, 8],
                user_features=True, attention_padding=1.25)
    return ModelConfig(**{**base, **kw})


def _inputs(cfg: ModelConfig, lengths: list[int], counts: list[int], requires_grad: bool = False):
    g = torch.Generator().manual_seed(0)
    L, C = torch.tensor(lengths), torch.tensor(counts)
    rows = lambda n: torch.randn(n, cfg.embedding_dim, generator=g).requires_grad_(requires_grad)  # noqa: E731
    n = len(lengths)
    ids, stamps = torch.zeros(int(L.sum() + C.sum()), dtype=torch.long), torch.zeros(int(L.sum() + C.sum()), dtype=torch.long)
    return (rows(int(L.sum())), rows(int(C.sum())), rows(n) if cfg.user_features else None, ids, L, C,
            stamps[:int(L.sum())], stamps[int(L.sum()):], torch.rand(int(C.sum()), 1, generator=g), torch.arange(n),
            torch.tensor(0), torch.tensor(1.0))


def _counted(task: SeqRecTask, inputs, backward: bool = False) -> int:
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        loss, _ = task(*inputs)
        if backward:
            loss.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("cfg", [_cfg(), _cfg(d_model=0, user_features=False), _cfg(num_layers=0, mlp_dims=[])],
                         ids=["projected", "embedding-width", "no-layers"])
@pytest.mark.parametrize("length,count", [(1, 1), (7, 3), (40, 1), (0, 2)])
def test_single_sample_matches_counter_exactly(cfg, length, count):
    torch.manual_seed(0)
    task = SeqRecTask(cfg, MAX_LEN)
    inputs = _inputs(cfg, [length], [count])
    assert task.flops([length], [count]) == _counted(task, inputs)


def test_equal_lengths_batch_is_unpadded_and_exact():
    """Equal histories and equal candidate counts: one group, nothing padded (unequal counts
    would pad the target attention's queries)."""
    cfg = _cfg()
    task = SeqRecTask(cfg, MAX_LEN)
    lengths, counts = [12] * 5, [3] * 5
    assert task.flops(lengths, counts) == _counted(task, _inputs(cfg, lengths, counts))


def _padded_attention(q_lengths: list[int], kv_lengths: list[int], dim: int, max_padding: float) -> float:
    """Attention FLOPs as the jagged layout runs them: each group padded to its longest member."""
    total = 0.0
    for members in group_by_length(kv_lengths, max_padding):
        lk = max(kv_lengths[i] for i in members)
        lq = max(max(q_lengths[i] for i in members), 1)
        total += attention([lq] * len(members), [lk] * len(members), dim, dim)
    return total


def test_batch_within_padding_bound_differs_by_exactly_the_padding():
    cfg = _cfg()
    task = SeqRecTask(cfg, MAX_LEN)
    lengths, counts = [30, 27, 25, 9, 8, 3, 0, 41], [2, 1, 3, 1, 1, 2, 1, 4]
    dim = cfg.d_model
    assert len(group_by_length(lengths, cfg.attention_padding)) > 1  # the layout pads this batch
    analytic = task.flops(lengths, counts)
    real = cfg.num_layers * attention(lengths, lengths, dim, dim) + attention(counts, lengths, dim, dim)
    padded = (cfg.num_layers * _padded_attention(lengths, lengths, dim, cfg.attention_padding)
              + _padded_attention(counts, lengths, dim, cfg.attention_padding))
    counted = _counted(task, _inputs(cfg, lengths, counts))
    assert padded > real
    assert counted == analytic - real + padded
    # The padding bound holds for the attention's FLOPs: at most max_padding^2 of the real ones here.
    assert counted <= analytic + (cfg.attention_padding**2 - 1) * real


def test_training_is_forward_and_twice_it_backward():
    """With the rows requiring gradients (the embeddings train), every matmul's backward computes
    the gradient of both operands: the counter's forward + backward is exactly 3x the forward."""
    cfg = _cfg()
    task = SeqRecTask(cfg, MAX_LEN)
    inputs = _inputs(cfg, [20], [3], requires_grad=True)
    assert training_flops(task, [20], [3]) == 3 * task.flops([20], [3]) == _counted(task, inputs, backward=True)


def test_lengths_sum_over_samples_and_refuse_device_tensors():
    cfg = _cfg()
    one = flops_module.seqrec_flops(cfg, [5], [2]) + flops_module.seqrec_flops(cfg, [9], [1])
    assert flops_module.seqrec_flops(cfg, torch.tensor([5, 9]), torch.tensor([2, 1])) == one
    with pytest.raises(ValueError, match="host lengths"):
        flops_module.seqrec_flops(cfg, torch.tensor([5], device="meta"), [1])
