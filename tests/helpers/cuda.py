"""What the GPU tests use to make an ordering bug visible every time: a kernel that keeps a
stream busy, so work another stream issues meanwhile runs first unless it was told to wait,
and an allocator with no cached blocks, so a block freed too early is the next one handed out.

Torch only: the torch tier of the GPU check imports it without TorchRec.
"""

from __future__ import annotations

import torch

HOLD_CYCLES = 200_000_000
"""GPU clock cycles a held stream spins: about 0.1 s at 2 GHz (longer at lower clocks), far
longer than the host takes to issue the few operations a test races against it."""

ELEMENTS = 1 << 22
"""Floats in a test tensor: 16 MiB, above the allocator's 10 MiB, so each has a segment of its
own and the block freed is the one the next tensor of that size gets."""


def hold(stream: torch.cuda.Stream | None = None, cycles: int = HOLD_CYCLES) -> None:
    """Keep ``stream`` (default: the current one) busy for ``cycles`` GPU clock cycles."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)


def settled() -> None:
    """Wait for the device and return the allocator's cached blocks to it."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def full(value: float, device="cuda") -> torch.Tensor:
    return torch.full((ELEMENTS,), value, device=device)
