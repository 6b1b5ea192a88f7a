"""The CPU dropout: its drop rate, its scale, its gradient, and that it is off in evaluation."""

import torch

from freescale.model.dropout import Dropout, keep_mask


def test_drop_rate_and_scale():
    torch.manual_seed(0)
    keep = keep_mask(torch.Size([1000, 1000]), 0.2)
    assert abs(keep.float().mean().item() - 0.8) < 2e-3
    x = torch.ones(300, 700, requires_grad=True)
    out = Dropout(0.25).train()(x)
    assert set(out.unique().tolist()) <= {0.0, torch.tensor(1.0 / 0.75).item()}
    out.sum().backward()
    assert torch.equal(x.grad, out.detach())  # the gradient is the same mask and scale


def test_repeatable_and_off_in_eval():
    x = torch.randn(50, 30)
    torch.manual_seed(3)
    a = Dropout(0.5).train()(x)
    torch.manual_seed(3)
    assert torch.equal(a, Dropout(0.5).train()(x))
    assert Dropout(0.5).eval()(x) is x
