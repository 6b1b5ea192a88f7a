"""Dropout whose masks belong to the sample, never to where it trains.

``torch.nn.Dropout`` draws its masks from the process's generator: which mask a token gets
depends on what the rank drew before it (its batch-mates, the step's other layers), so the
balancer moving a sample to another rank, a replica group training another shard, a step
trained again after a failed vote or a resumed run would each change the masks, and with them
the weights. Here a token's mask is a hash of a key and the feature: the key of a token is a
hash of the run's seed, its sample's position in the training stream (``Samples.
stream_positions``: counted across epochs, the same whichever rank or group trains the sample)
and the token's index in its sample; each dropout site mixes in its own number. So a sample
draws the same masks wherever it trains and new ones every epoch; the process's generator is
never touched (replica groups keep equal generator states), and the masks cost a few integer
operations per element on the device. The hash is splitmix64's finalizer, on int64 tensors
(multiplication wraps; right shifts are made logical with a mask).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
SITE_STRIDE = 1 << 20
"""Features per site in a mask's hash input (a site's features never meet the next site's)."""


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


def _shift_right(x: torch.Tensor, s: int) -> torch.Tensor:
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors (bit for bit the uint64 function)."""
    x = (x ^ _shift_right(x, 30)) * _signed(_M1)
    x = (x ^ _shift_right(x, 27)) * _signed(_M2)
    return x ^ _shift_right(x, 31)


def _mix_np(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(_M1)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(_M2)
        return x ^ (x >> np.uint64(31))


def token_keys(seed: int, stream_positions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """int64 [sum(lengths)] keys of the packed tokens of samples at ``stream_positions`` with
    ``lengths`` tokens each (host tensors; computed on the host)."""
    lengths = lengths.numpy()
    within = np.arange(int(lengths.sum()), dtype=np.uint64) - np.repeat(np.cumsum(lengths) - lengths, lengths).astype(np.uint64)
    with np.errstate(over="ignore"):
        sample = _mix_np(np.asarray(stream_positions.numpy(), dtype=np.uint64) + np.uint64(_GOLDEN) * np.uint64(seed + 1))
        keys = _mix_np(np.repeat(sample, lengths) ^ (within * np.uint64(_GOLDEN)))
    return torch.from_numpy(keys.view(np.int64))


def keep_mask(keys: torch.Tensor, features: int, site: int, p: float) -> torch.Tensor:
    """[len(keys), features] bool: which elements a dropout of rate ``p`` at ``site`` keeps."""
    feature = torch.arange(features, device=keys.device, dtype=torch.int64) + site * SITE_STRIDE
    h = mix(keys[:, None] ^ (feature[None, :] * _signed(_GOLDEN)))
    uniform = _shift_right(h, 40).to(torch.float32) * (1.0 / (1 << 24))  # 24 random bits in [0, 1)
    return uniform >= p


class KeyedDropout(nn.Module):
    """Dropout of rate ``p`` at dropout site ``site``: with token ``keys`` (int64 [T], on the
    input's device) the masks are ``keep_mask``'s; without them, ``torch.nn.Dropout``'s."""

    def __init__(self, p: float, site: int) -> None:
        super().__init__()
        self.p = p
        self.site = site

    def forward(self, x: torch.Tensor, keys: torch.Tensor | None = None) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if keys is None:
            return F.dropout(x, self.p, training=True)
        keep = keep_mask(keys, x.shape[-1], self.site, self.p)
        return x * keep.to(x.dtype) * (1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site}"
