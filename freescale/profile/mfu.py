"""Model FLOPs utilisation: the model FLOP/s a replica group achieved against its matmul peak.

Achieved FLOP/s = the training FLOPs (``freescale.model.flops.training_flops``, forward and
backward, counted on the host from each step's lengths) of the samples the group's ranks
trained, over the wall time they took. MFU = that / (the measured per-rank matmul peak
(``freescale.profile.peak``) x the group's ranks): the fraction of the group's matmul capacity
the model's own FLOPs used. Padding, recomputation, embedding lookups and communication do not
count as useful FLOPs; every second they take lowers MFU. Pure arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass


def mfu(flops: float, seconds: float, peak_flop_per_s: float, ranks: int) -> float:
    """The fraction of ``ranks`` ranks' peak that ``flops`` in ``seconds`` used (0 without a peak)."""
    capacity = peak_flop_per_s * ranks * seconds
    return flops / capacity if capacity > 0 else 0.0


def measures(flops: float, samples: float, seconds: float, peak_flop_per_s: float, ranks: int) -> dict:
    """The efficiency figures of ``samples`` trained with ``flops`` in ``seconds`` by ``ranks`` ranks."""
    return {
        "train/tflops(TFLOP/s)": round(flops / seconds / 1e12, 6) if seconds > 0 else 0.0,
        "train/mfu(%)": round(100.0 * mfu(flops, seconds, peak_flop_per_s, ranks), 4),
        "train/flop_per_sample": round(flops / samples, 1) if samples else 0.0,
    }


@dataclass
class FlopsTally:
    """Training FLOPs, samples and wall time summed over log windows (the run's summary)."""

    flops: float = 0.0
    samples: float = 0.0
    seconds: float = 0.0

    def add(self, flops: float, samples: float, seconds: float) -> None:
        self.flops += flops
        self.samples += samples
        self.seconds += seconds
