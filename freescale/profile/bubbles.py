"""Bubble arithmetic on step records (pure; see docs/design.md, "Measures").

Per rank ``r`` and step, from a record (``start``, ``end``, main-thread ``cpu`` and
``cpu_wait``, ``data`` spans and their ``data_cpu`` and ``data_cpu_wait``):

- ``T`` = end - start (step wall time);
- ``D`` = time in ``data`` spans (waiting for the loader);
- ``C`` = cpu - data_cpu (own compute: the CPU the rank spent outside data loading); on a GPU,
  ``device_compute`` (device time in the compute spans less the waits in them, from CUDA
  events), and ``T`` is at least the device's step (``device_step``);
- ``R`` = cpu_wait - data_cpu_wait (ready to compute, waiting for a core: on a busy machine
  the rank's compute takes ``C + R`` of wall time); 0 on a GPU and where it was not recorded;
- ``W`` = T - C - D (not computing: blocked in communication, or waiting for a core);
- compute end = start + D + C + R: when ``r`` would be done, on the wall clock, if it never
  waited for anyone;
- straggler bubble = max over peers of their compute end minus ``r``'s, within ``W - R``
  (a rank waits for its peers only while it is blocked);
- exposed communication = W - straggler bubble (``R`` included: time a rank is off its core
  beside its communication is exposed to the step, as the simulator prices it).

Per run: bubble fraction = mean of (T - C) / T over ranks and steps after warm-up (with
p50/p90/max); straggler % = mean straggler bubble / mean step time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass
class RankStep:
    rank: int
    step: int
    start: float
    T: float
    C: float
    D: float
    R: float
    W: float
    straggler: float
    exposed: float
    uih_tokens: int

    @property
    def bubble_fraction(self) -> float:
        return (self.T - self.C) / self.T if self.T > 0 else 0.0


def _data_time(record: dict) -> float:
    return sum(t1 - t0 for kind, t0, t1 in record.get("spans", []) if kind == "data")


def _compute(record: dict) -> float:
    """The rank's own compute in a step: the device's (``device_compute``, from events on its
    streams) on a GPU, else the main thread's CPU outside data loading."""
    if "device_compute" in record:
        return record["device_compute"]
    return record["cpu"] - record.get("data_cpu", 0.0)


def _cpu_wait(record: dict) -> float:
    """The rank's time ready to compute but waiting for a core, outside data loading (none when
    compute comes from the device, whose work no busy host thread delays, or when the record
    does not have it)."""
    if "device_compute" in record:
        return 0.0
    return record.get("cpu_wait", 0.0) - record.get("data_cpu_wait", 0.0)


def decompose(steps_by_rank: dict[int, list[dict]]) -> list[RankStep]:
    """Decompose every step that all ranks recorded."""
    by_step = {r: {rec["step"]: rec for rec in recs} for r, recs in steps_by_rank.items()}
    common = sorted(set.intersection(*(set(s) for s in by_step.values()))) if by_step else []
    out = []
    for step in common:
        rows = []
        for rank in sorted(by_step):
            rec = by_step[rank][step]
            T = max(rec["end"] - rec["start"], rec.get("device_step", 0.0), 0.0)
            D = min(_data_time(rec), T)
            C = min(max(_compute(rec), 0.0), T - D)
            R = min(max(_cpu_wait(rec), 0.0), T - D - C)
            rows.append((rank, rec, T, C, D, R, rec["start"] + D + C + R))
        last_end = max(r[6] for r in rows)
        for rank, rec, T, C, D, R, compute_end in rows:
            W = T - C - D
            straggler = min(max(last_end - compute_end, 0.0), W - R)
            out.append(RankStep(rank=rank, step=step, start=rec["start"], T=T, C=C, D=D, R=R, W=W,
                                straggler=straggler, exposed=W - straggler, uih_tokens=rec.get("uih_tokens", 0)))
    return out


def _ms(x: float) -> float:
    return round(1000.0 * float(x), 3)


def summarize(rank_steps: list[RankStep], warmup_steps: int = 0) -> dict:
    """Run summary and per-rank per-step means (milliseconds) over the steps after warm-up.

    A run no longer than its warm-up is summarized over all its steps; the summary then says
    so (``warmup_steps`` 0, ``warmup_covered_all_steps`` true) rather than report nothing.
    """
    if not rank_steps:
        raise ValueError("no complete steps to summarize")
    kept = [s for s in rank_steps if s.step > warmup_steps]
    covered = not kept
    if covered:
        kept, warmup_steps = list(rank_steps), 0
    arr = lambda f: np.array([f(s) for s in kept], dtype=np.float64)
    T, C, D, S, E = arr(lambda s: s.T), arr(lambda s: s.C), arr(lambda s: s.D), arr(lambda s: s.straggler), arr(lambda s: s.exposed)
    R = arr(lambda s: s.R)
    bubble = arr(lambda s: s.bubble_fraction)
    ranks = sorted({s.rank for s in kept})
    steps = sorted({s.step for s in kept})
    summary = {
        "bubble_fraction": round(float(bubble.mean()), 6),
        "bubble_fraction_p50": round(float(np.percentile(bubble, 50)), 6),
        "bubble_fraction_p90": round(float(np.percentile(bubble, 90)), 6),
        "bubble_fraction_max": round(float(bubble.max()), 6),
        "straggler_pct": round(100.0 * float(S.mean() / T.mean()), 4),
        "exposed_comm_ms_per_step": _ms(E.mean()),
        "data_wait_ms_per_step": _ms(D.mean()),
        "cpu_wait_ms_per_step": _ms(R.mean()),
        "straggler_bubble_ms_per_step": _ms(S.mean()),
        "straggler_bubble_ms_p50": _ms(np.percentile(S, 50)),
        "straggler_bubble_ms_p90": _ms(np.percentile(S, 90)),
        "straggler_bubble_ms_max": _ms(S.max()),
        "step_ms": _ms(T.mean()),
        "compute_ms_per_step": _ms(C.mean()),
        "steps": len(steps),
        "first_step": steps[0],
        "last_step": steps[-1],
        "warmup_steps": warmup_steps,
        "warmup_covered_all_steps": covered,
        "ranks": len(ranks),
    }
    per_rank = []
    for r in ranks:
        mine = [s for s in kept if s.rank == r]
        mean = lambda f: float(np.mean([f(s) for s in mine]))
        per_rank.append({
            "rank": r,
            "step_ms": _ms(mean(lambda s: s.T)),
            "compute_ms": _ms(mean(lambda s: s.C)),
            "straggler_bubble_ms": _ms(mean(lambda s: s.straggler)),
            "exposed_comm_ms": _ms(mean(lambda s: s.exposed)),
            "data_wait_ms": _ms(mean(lambda s: s.D)),
            "cpu_wait_ms": _ms(mean(lambda s: s.R)),
            "bubble_fraction": round(mean(lambda s: s.bubble_fraction), 6),
            "uih_tokens_per_step": round(mean(lambda s: s.uih_tokens), 2),
        })
    return {"summary": summary, "per_rank": per_rank}


def blocked_by_span(records: list[dict]) -> dict[str, float]:
    """Per span kind, the main thread's time in it off its CPU (the span's wall time less its
    ``span_cpu``: blocked on an exchange, or waiting for a core), ms per step over ``records``
    (the step records of the ranks and steps summarized), largest first. A span inside another
    counts in both: the kinds do not add up to the step."""
    if not records:
        return {}
    blocked: dict[str, float] = {}
    for rec in records:
        for kind, t0, t1 in rec.get("spans", []):
            blocked[kind] = blocked.get(kind, 0.0) + (t1 - t0)
        for kind, cpu in rec.get("span_cpu", {}).items():
            blocked[kind] = blocked.get(kind, 0.0) - cpu
    out = {kind: round(1000.0 * max(0.0, t) / len(records), 3) for kind, t in blocked.items()}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def as_rows(rank_steps: list[RankStep]) -> list[dict]:
    return [asdict(s) for s in rank_steps]
