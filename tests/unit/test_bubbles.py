"""The bubble arithmetic on hand-built timelines (seconds)."""

import math

import pytest

from freescale.profile.bubbles import blocked_by_span, decompose, summarize


def rec(step, start, end, cpu, data=(), data_cpu=0.0, cpu_wait=None, data_cpu_wait=0.0):
    spans = [["data", s, e] for s, e in data]
    record = {"step": step, "start": start, "end": end, "cpu": cpu, "data_cpu": data_cpu, "spans": spans,
              "uih_tokens": 10}
    if cpu_wait is not None:
        record.update(cpu_wait=cpu_wait, data_cpu_wait=data_cpu_wait)
    return record


def by(rank_steps):
    return {(s.rank, s.step): s for s in rank_steps}


def close(a, b):
    return math.isclose(a, b, abs_tol=1e-9)


def test_balanced_ranks_have_no_bubble():
    steps = by(decompose({0: [rec(1, 0.0, 0.1, 0.1)], 1: [rec(1, 0.0, 0.1, 0.1)]}))
    for r in (0, 1):
        s = steps[(r, 1)]
        assert close(s.C, 0.1) and close(s.W, 0.0) and close(s.straggler, 0.0) and close(s.exposed, 0.0)


def test_slow_peer_then_slow_transfer():
    # Rank 0 computes 50 ms, rank 1 150 ms; then both wait 30 ms more for the transfer.
    steps = by(decompose({0: [rec(1, 0.0, 0.180, 0.050)], 1: [rec(1, 0.0, 0.180, 0.150)]}))
    fast, slow = steps[(0, 1)], steps[(1, 1)]
    assert close(fast.W, 0.130) and close(fast.straggler, 0.100) and close(fast.exposed, 0.030)
    assert close(slow.W, 0.030) and close(slow.straggler, 0.0) and close(slow.exposed, 0.030)
    assert close(fast.bubble_fraction, 0.130 / 0.180)


def test_a_rank_waiting_for_data_is_the_straggler_of_its_peers():
    # Rank 1 waits 80 ms for its loader (10 ms of it on CPU), then computes 40 ms; rank 0 computes 40 ms.
    r1 = rec(1, 0.0, 0.125, cpu=0.050, data=[(0.0, 0.080)], data_cpu=0.010)
    r0 = rec(1, 0.0, 0.125, cpu=0.040)
    steps = by(decompose({0: [r0], 1: [r1]}))
    loader_bound, peer = steps[(1, 1)], steps[(0, 1)]
    assert close(loader_bound.D, 0.080) and close(loader_bound.C, 0.040)
    assert close(loader_bound.straggler, 0.0) and close(loader_bound.exposed, 0.005)
    assert close(peer.D, 0.0) and close(peer.straggler, 0.080) and close(peer.exposed, 0.005)


def test_clock_offsets_and_unaligned_starts():
    # Rank 1 starts 20 ms later (its clock already corrected) and computes as long: it is 20 ms behind.
    steps = by(decompose({0: [rec(1, 1.000, 1.100, 0.060)], 1: [rec(1, 1.020, 1.100, 0.060)]}))
    assert close(steps[(0, 1)].straggler, 0.020)
    assert close(steps[(1, 1)].straggler, 0.0)


def test_straggler_bubble_is_capped_by_waiting():
    # Rank 0 ends its step before rank 1 finishes computing (no collective in between): no wait to blame.
    steps = by(decompose({0: [rec(1, 0.0, 0.050, 0.050)], 1: [rec(1, 0.0, 0.200, 0.200)]}))
    assert close(steps[(0, 1)].straggler, 0.0)


def test_only_steps_all_ranks_recorded_are_decomposed():
    out = decompose({0: [rec(1, 0, 1, 1), rec(2, 1, 2, 1)], 1: [rec(2, 1, 2, 1)]})
    assert sorted({s.step for s in out}) == [2]


def test_summary_means_after_warmup():
    timelines = {
        0: [rec(1, 0.0, 1.0, 0.1)] + [rec(s, s - 1.0, s - 0.8, 0.05) for s in (2, 3)],
        1: [rec(1, 0.0, 1.0, 0.1)] + [rec(s, s - 1.0, s - 0.8, 0.15) for s in (2, 3)],
    }
    result = summarize(decompose(timelines), warmup_steps=1)
    s = result["summary"]
    assert s["steps"] == 2 and s["ranks"] == 2 and s["first_step"] == 2
    assert s["step_ms"] == pytest.approx(200.0)
    # Rank 0 waits 100 ms for rank 1 each step: mean straggler 50 ms over a 200 ms step.
    assert s["straggler_bubble_ms_per_step"] == pytest.approx(50.0)
    assert s["straggler_pct"] == pytest.approx(25.0)
    assert s["exposed_comm_ms_per_step"] == pytest.approx(50.0)  # both ranks wait 50 ms beyond the straggler
    assert s["bubble_fraction"] == pytest.approx(((0.15 / 0.2) + (0.05 / 0.2)) / 2)
    per_rank = {p["rank"]: p for p in result["per_rank"]}
    assert per_rank[0]["straggler_bubble_ms"] == pytest.approx(100.0) and per_rank[1]["straggler_bubble_ms"] == 0
    assert per_rank[0]["compute_ms"] == pytest.approx(50.0) and per_rank[1]["exposed_comm_ms"] == pytest.approx(50.0)


def test_three_ranks_wait_for_the_slowest_not_the_mean_or_the_nearest():
    # Compute ends at 50, 100 and 200 ms; everyone leaves the collective at 230 ms.
    steps = by(decompose({0: [rec(1, 0.0, 0.230, 0.050)], 1: [rec(1, 0.0, 0.230, 0.100)],
                          2: [rec(1, 0.0, 0.230, 0.200)]}))
    assert close(steps[(0, 1)].straggler, 0.150)  # not 0.100 (mean of peers) nor 0.050 (nearest)
    assert close(steps[(1, 1)].straggler, 0.100)
    assert close(steps[(2, 1)].straggler, 0.0) and close(steps[(2, 1)].exposed, 0.030)
    assert close(steps[(0, 1)].exposed, 0.030) and close(steps[(1, 1)].exposed, 0.030)


def test_four_ranks_with_data_waits_offsets_and_a_capped_bubble():
    timelines = {
        0: [rec(1, 1.000, 1.300, 0.100)],  # computes 100 ms
        1: [rec(1, 1.010, 1.300, 0.090, data=[(1.010, 1.050)], data_cpu=0.005)],  # starts late, waits for data
        2: [rec(1, 1.000, 1.300, 0.260)],  # the straggler: compute ends at 1.260
        3: [rec(1, 1.000, 1.120, 0.100)],  # leaves at 1.120, before rank 2 is done: its wait is all it can lose
    }
    steps = by(decompose(timelines))
    assert close(steps[(0, 1)].straggler, 0.160) and close(steps[(0, 1)].exposed, 0.040)
    one = steps[(1, 1)]  # compute end 1.010 + 0.040 (data) + 0.085 = 1.135
    assert close(one.D, 0.040) and close(one.C, 0.085) and close(one.straggler, 0.125)
    assert close(steps[(2, 1)].straggler, 0.0)
    assert close(steps[(3, 1)].W, 0.020) and close(steps[(3, 1)].straggler, 0.020)  # capped by W
    s = summarize(decompose(timelines))["summary"]
    assert s["straggler_bubble_ms_per_step"] == pytest.approx(1000 * (0.160 + 0.125 + 0.0 + 0.020) / 4)
    assert s["straggler_bubble_ms_max"] == pytest.approx(160.0)


def test_a_run_no_longer_than_its_warmup_is_summarized_over_every_step():
    timelines = {r: [rec(s, s - 1.0, s - 0.9, 0.05 * (r + 1)) for s in (1, 2, 3)] for r in (0, 1)}
    s = summarize(decompose(timelines), warmup_steps=3)["summary"]
    assert s["steps"] == 3 and s["first_step"] == 1
    assert s["warmup_steps"] == 0 and s["warmup_covered_all_steps"] is True
    s = summarize(decompose(timelines), warmup_steps=2)["summary"]
    assert s["steps"] == 1 and s["warmup_steps"] == 2 and s["warmup_covered_all_steps"] is False


def test_on_a_busy_machine_compute_ends_later_by_the_wait_for_a_core():
    # Two CPU-bound processes beside the ranks. Rank 1 spins 200 ms of wall time (an injected
    # straggler) beside 10 ms of compute: it gets 110 ms of CPU and waits 100 ms for a core, so its
    # compute ends at 210 ms on the wall clock. Rank 0 computes 10 ms over 22 ms of wall time
    # and waits for rank 1 in the collective; both leave it at 250 ms.
    waiting, late = rec(1, 0.0, 0.250, cpu=0.010, cpu_wait=0.012), rec(1, 0.0, 0.250, cpu=0.110, cpu_wait=0.100)
    steps = by(decompose({0: [waiting], 1: [late]}))
    assert close(steps[(0, 1)].straggler, 0.188)  # 210 - 22 ms: not 100 ms, as the CPU alone would say
    assert close(steps[(0, 1)].R, 0.012) and close(steps[(0, 1)].exposed, 0.250 - 0.010 - 0.188)
    assert close(steps[(1, 1)].straggler, 0.0) and close(steps[(1, 1)].exposed, 0.140)  # its wait for a core
    per_rank = {p["rank"]: p for p in summarize(decompose({0: [waiting], 1: [late]}))["per_rank"]}
    assert per_rank[1]["cpu_wait_ms"] == pytest.approx(100.0) and per_rank[0]["cpu_wait_ms"] == pytest.approx(12.0)


def test_the_wait_for_a_core_in_data_loading_is_data_wait_and_a_rank_waits_for_peers_only_while_blocked():
    # Rank 1 waits 40 ms for its loader, 10 ms of it for a core, then computes 50 ms over 70 ms.
    loading = rec(1, 0.0, 0.150, cpu=0.050, data=[(0.0, 0.040)], cpu_wait=0.030, data_cpu_wait=0.010)
    steps = by(decompose({0: [rec(1, 0.0, 0.150, cpu=0.020, cpu_wait=0.0)], 1: [loading]}))
    assert close(steps[(1, 1)].D, 0.040) and close(steps[(1, 1)].R, 0.020)
    assert close(steps[(0, 1)].straggler, 0.090)  # rank 1's compute ends at 40 + 50 + 20 ms
    # A rank that waited for a core the whole time it was not computing waited for no peer.
    busy = by(decompose({0: [rec(1, 0.0, 0.100, cpu=0.020, cpu_wait=0.080)], 1: [rec(1, 0.0, 0.100, cpu=0.100)]}))
    assert close(busy[(0, 1)].straggler, 0.0) and close(busy[(0, 1)].exposed, 0.080)
    # The wait for a core is capped by the time the rank did not compute, and a device-timed
    # record's compute is the device's, which no busy host thread stretches.
    capped = by(decompose({0: [rec(1, 0.0, 0.100, cpu=0.060, cpu_wait=0.090)]}))
    assert close(capped[(0, 1)].R, 0.040)
    device = dict(rec(1, 0.0, 0.100, cpu=0.005, cpu_wait=0.050), device_compute=0.060)
    assert close(by(decompose({0: [device]}))[(0, 1)].R, 0.0)


def test_blocked_time_per_span_kind_is_its_wall_time_off_the_cpu_per_step():
    # Two steps. Step 1: a backward of 80 ms wall with 60 ms of CPU holds a 15 ms wait with no
    # CPU; an optimizer span of 12 ms with 2 ms of CPU. Step 2: a backward of 40 ms with 40 ms of
    # CPU, and a collision wait whose CPU reads a hair above its wall time (clock granularity).
    step1 = {"spans": [["optimizer", 0.080, 0.092], ["backward", 0.0, 0.080], ["wait", 0.030, 0.045]],
             "span_cpu": {"backward": 0.060, "wait": 0.0, "optimizer": 0.002}}
    step2 = {"spans": [["backward", 0.0, 0.040], ["collision_wait", 0.040, 0.041]],
             "span_cpu": {"backward": 0.040, "collision_wait": 0.0011}}
    got = blocked_by_span([step1, step2])
    # per step: backward (20 + 0) / 2, the nested wait 15 / 2 (also inside backward's 20), the
    # optimizer 10 / 2; the collision wait never below zero; largest first
    assert got == {"backward": 10.0, "wait": 7.5, "optimizer": 5.0, "collision_wait": 0.0}
    assert list(got) == ["backward", "wait", "optimizer", "collision_wait"]
    assert blocked_by_span([]) == {}


@pytest.mark.parametrize("ranks", [1, 2, 8])
def test_the_timeline_charts_legend_leaves_the_axis_label_and_the_plot_clear(ranks):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from freescale.profile.report import _plot_gantt

    raw = {r: [{"step": s, "start": s * 0.1, "end": s * 0.1 + 0.08,
                "spans": [["forward", s * 0.1, s * 0.1 + 0.03], ["backward", s * 0.1 + 0.03, s * 0.1 + 0.07]]}
               for s in range(1, 7)] for r in range(ranks)}
    steps = [{"rank": r, "step": s, "straggler": 0.01 * r, "start": s * 0.1, "D": 0.0, "C": 0.05, "R": 0.0}
             for r in range(ranks) for s in range(1, 7)]
    fig = _plot_gantt({"_raw": raw, "rank_steps": steps}, window=6)
    fig.canvas.draw()
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    legend = fig.legends[0].get_window_extent(renderer)
    for part in (ax.xaxis.label, ax.xaxis, ax):
        box = part.get_window_extent(renderer) if part is not ax.xaxis else part.get_tightbbox(renderer)
        assert not legend.overlaps(box), (part, legend, box)
    plt.close(fig)


def test_a_rank_that_imports_the_trainer_does_not_import_matplotlib():
    # Only rank 0 draws the report, once the run ends; the import is half a second per rank.
    import subprocess
    import sys

    from helpers.launch import REPO

    code = "import sys, freescale.train.trainer; print('matplotlib' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr[-2000:]
