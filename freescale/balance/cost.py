"""The per-sample cost model: ``cost(L, C) = a*L + b*L^2 + c*C + d`` (seconds of forward+backward).

``L`` is the UIH length and ``C`` the candidate count. ``freescale calibrate`` fits the
coefficients on the real model and machine. The default is such a fit: the quickstart model
(width 32, 2 layers, 2 heads) on a 2-core x86 CPU with one thread per rank, over lengths 4 to
4096 (``freescale calibrate --config configs/bench_balance.yaml``); it keeps what matters to a
partition with any model of this family: a constant per sample and a quadratic term.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

import numpy as np

from freescale.io import write_json_atomic


class CostModelError(ValueError):
    """A cost model file that cannot be used; one line naming the file."""


@dataclass(frozen=True)
class CostModel:
    a: float = 4.955e-6
    """Seconds per history token (projections, feed-forward, embeddings)."""
    b: float = 2.232e-8
    """Seconds per squared history token (attention scores)."""
    c: float = 8.578e-7
    """Seconds per candidate (target attention, head)."""
    d: float = 6.816e-5
    """Seconds per sample, whatever its size."""
    fit: dict = field(default_factory=dict, compare=False)
    """How the coefficients were obtained (R^2, worst relative error, grid, model)."""

    def cost(self, lengths, candidates=None) -> np.ndarray:
        L = np.asarray(lengths, dtype=np.float64)
        C = np.zeros_like(L) if candidates is None else np.asarray(candidates, dtype=np.float64)
        return self.a * L + self.b * L * L + self.c * C + self.d

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_json_atomic(path, asdict(self))

    @staticmethod
    def load(path: str) -> "CostModel":
        if not os.path.isfile(path):
            raise CostModelError(f"cost model file not found: {path}")
        try:
            with open(path) as f:
                data = json.load(f)
            model = CostModel(**{k: (float(v) if k != "fit" else v) for k, v in data.items()})
        except (json.JSONDecodeError, TypeError, ValueError) as e:
            raise CostModelError(f"{path}: not a cost model ({str(e).splitlines()[0]}); expected keys a, b, c, d") from None
        if min(model.a, model.b, model.c, model.d) < 0:
            raise CostModelError(f"{path}: coefficients must be >= 0, got a={model.a} b={model.b} c={model.c} d={model.d}")
        return model


def load_cost_model(path: str) -> CostModel:
    """``path`` if given, else the default."""
    return CostModel.load(path) if path else CostModel()


def fit_cost_model(lengths, candidates, seconds, info: dict | None = None) -> CostModel:
    """Least-squares fit of (a, b, c, d) >= 0 to measured per-sample seconds.

    Residuals are relative (each row divided by its measurement), so short samples, which
    dominate real batches, are fitted as well as long ones. Negative coefficients are
    clamped to zero by refitting without them.
    """
    L = np.asarray(lengths, dtype=np.float64)
    C = np.asarray(candidates, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    X = np.stack([L, L * L, C, np.ones_like(L)], axis=1)
    w = 1.0 / y
    active = [0, 1, 2, 3]
    while True:
        coef, *_ = np.linalg.lstsq(X[:, active] * w[:, None], y * w, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(coef)))
    full = np.zeros(4)
    full[active] = np.maximum(coef, 0)
    pred = X @ full
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    fit = {"r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
           "worst_relative_error": float(np.max(np.abs(pred - y) / y)), "points": int(len(y)), **(info or {})}
    return CostModel(*map(float, full), fit=fit)
