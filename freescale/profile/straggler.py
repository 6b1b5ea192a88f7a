"""Straggler injection: make chosen ranks slower by a known amount, to validate profiling.

The delay is busy compute (a spin on the rank's main thread) added after its forward pass,
so it counts as the rank's own compute exactly as a longer forward would, and its peers wait
for it at the next collective.
"""

from __future__ import annotations

import time

import torch


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def inject_delay(model: torch.nn.Module, timeline, *, rank: int, ranks: list[int], delay_ms: float) -> None:
    """Register the delay on ``model``'s forward when ``rank`` is one of ``ranks``."""
    if rank not in ranks or delay_ms <= 0:
        return

    def delay(module, _inputs, _output):
        if module.training:
            with timeline.span("injected_delay"):
                spin(delay_ms / 1000.0)

    model.register_forward_hook(delay)
