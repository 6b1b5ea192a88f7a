"""Dropout whose random mask costs a third of the generator calls on CPU.

On CPU, ``nn.Dropout`` draws one number from the generator per element (``bernoulli_``), and
the draws, not the arithmetic, are its cost: about 15 ns each, a few milliseconds for one
``[tokens, width]`` activation, several times a step's elementwise work. Here each 64-bit draw
(63 random bits) gives three 21-bit uniforms, and an element is dropped when its uniform is
below ``round(p * 2^21)``: the drop probability is ``p`` to within ``2^-22``, the kept values
are scaled by ``1 / (1 - p)`` as ``nn.Dropout`` does, and the mask comes from torch's default
generator (``torch.manual_seed`` makes it repeatable). On an accelerator it is ``nn.Dropout``
(a fused kernel there).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

BITS = 21
"""Bits per uniform: three of them fill a 63-bit draw."""


def keep_mask(shape: torch.Size, p: float) -> torch.Tensor:
    """A bool mask of ``shape``, each element True with probability ``1 - p`` (to 2^-22)."""
    n = math.prod(shape)
    words = torch.empty((n + 2) // 3, dtype=torch.int64).random_()
    low = (1 << BITS) - 1
    uniforms = torch.stack([words & low, (words >> BITS) & low, words >> (2 * BITS)], dim=1).reshape(-1)[:n]
    return (uniforms >= round(p * (1 << BITS))).view(shape)


class Dropout(nn.Dropout):
    """``nn.Dropout`` with the cheaper mask on CPU (see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if x.device.type != "cpu" or self.p >= 1.0 or self.inplace:
            return F.dropout(x, self.p, True, self.inplace)
        return x.mul(keep_mask(x.shape, self.p)).mul_(1.0 / (1.0 - self.p))
