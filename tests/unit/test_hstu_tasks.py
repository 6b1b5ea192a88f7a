"""HSTU retrieval's L2 normalization: F.normalize's values and gradients, zero rows included."""

import torch
import torch.nn.functional as F

from freescale.model.hstu_tasks import _L2Normalize


def test_l2_normalize_matches_torch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 8, dtype=torch.float64, generator=g)
    x[3], x[4] = 0.0, 1e-14  # a zero row and one below the clamp
    x.requires_grad_()
    grad = torch.randn(40, 8, dtype=torch.float64, generator=g)
    ours = _L2Normalize.apply(x)
    theirs = F.normalize(x, dim=-1)
    assert torch.equal(ours, theirs)
    torch.testing.assert_close(torch.autograd.grad(ours, x, grad)[0], torch.autograd.grad(theirs, x, grad)[0])
