"""The simulator: its pieces against references, its figures against the profiler's own
arithmetic, and `freescale simulate` end to end."""

import dataclasses
import json
import math

import numpy as np
import pytest

from freescale.balance.cost import CostModel
from freescale.config import load_config
from freescale.profile.bubbles import decompose, summarize
from freescale.sim.simulator import (LengthSampler, all_reduce_s, all_to_all_s, effective_training_time,
                                     processor_sharing, simulate_steps, step_timings, variants)
from helpers.launch import REPO, freescale

FREESCALE = str(REPO / "configs" / "freescale.yaml")


def _sharing_by_time_steps(work, cores, dt=1e-4):
    """Processor sharing, the slow way: advance time in small steps, sharing the cores."""
    left = np.array(work, dtype=np.float64)
    finish = np.full(len(left), np.nan)
    t = 0.0
    while np.isnan(finish).any():
        running = np.flatnonzero(np.isnan(finish))
        rate = min(1.0, cores / len(running))
        left[running] -= rate * dt
        t += dt
        finish[running[left[running] <= 0]] = t
    return finish


@pytest.mark.parametrize("work,cores", [([0.05, 0.2, 0.1, 0.3], 2), ([0.1, 0.1, 0.4], 2), ([0.2, 0.05, 0.1], 1)])
def test_processor_sharing_matches_a_time_stepped_reference(work, cores):
    assert np.allclose(processor_sharing(work, cores), _sharing_by_time_steps(work, cores), atol=3e-4)


def test_ranks_with_a_core_each_finish_when_their_work_is_done():
    work = [0.3, 0.1, 0.2]
    assert processor_sharing(work, 0).tolist() == work and processor_sharing(work, 4).tolist() == work


def test_collective_prices_follow_latency_plus_bytes_over_bandwidth():
    sim = load_config(FREESCALE, ["sim.ranks_per_host=8", "sim.intra_bandwidth_gbs=100", "sim.intra_latency_us=10",
                                  "sim.inter_bandwidth_gbs=10", "sim.inter_latency_us=20"]).sim
    assert all_to_all_s(1e9, 1, sim) == 0.0 and all_reduce_s(1e9, 1, sim) == 0.0
    # 2 ranks, one host: half the bytes stay home, the other half cross the intra-host link once.
    assert all_to_all_s(1e9, 2, sim) == pytest.approx(10e-6 + 0.5e9 / 100e9)
    # 16 ranks on 2 hosts: 8/16 of the bytes leave the host at 10 GB/s; 3 + 1 latency rounds.
    assert all_to_all_s(1e9, 16, sim, messages=2) == pytest.approx(2 * (3 * 10e-6 + 20e-6) + 0.5e9 / 10e9)
    # Ring inside the host, a host's eighth across hosts.
    assert all_reduce_s(8e8, 16, sim) == pytest.approx(2 * 50e-6 + 2 * 8e8 * 7 / 8 / 100e9 + 2 * 1e8 / 2 / 10e9)
    # The dense all-reduce rides torch.distributed's backend, not the transport: its own
    # intra-host link where one is given; the all-to-alls keep the transport's.
    backend = dataclasses.replace(sim, backend_intra_bandwidth_gbs=25, backend_intra_latency_us=40)
    assert all_reduce_s(8e8, 16, backend) == pytest.approx(2 * (3 * 40e-6 + 20e-6) + 2 * 8e8 * 7 / 8 / 25e9 + 2 * 1e8 / 2 / 10e9)
    assert all_to_all_s(1e9, 2, backend) == all_to_all_s(1e9, 2, sim)


def test_effective_training_time_of_both_recoveries():
    sim = load_config(FREESCALE, ["sim.failures_per_rank_hour=1e-5", "sim.restart_s=600", "sim.checkpoint_every_s=1800",
                                  "sim.replica_stall_s=60", "sim.rejoin_s=600", "sim.replica_ranks=8"]).sim
    ett = effective_training_time(36000, sim)  # 0.36 failures an hour: one every 10,000 s
    assert ett["hours_between_failures"] == pytest.approx(10000 / 3600)
    assert ett["sync_restart"] == pytest.approx(10000 / (10000 + 600 + 900))
    assert ett["replica_layer"] == pytest.approx(10000 / (10000 + 60 + 600 * 8 / 36000))


@pytest.fixture(scope="module")
def cpu_box():
    cfg = load_config(FREESCALE, ["sim.steps=30", "sim.cores_per_host=2", "sim.ranks_per_host=4",
                                  "sim.compute_jitter=0.1", "sim.step_overhead_ms=40", "sim.intra_bandwidth_gbs=1",
                                  "sim.intra_latency_us=500"])
    return cfg, LengthSampler(cfg), CostModel()


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_the_figures_are_what_the_profiler_reports_for_the_same_steps(cpu_box, ranks):
    cfg, sampler, model = cpu_box
    for variant in variants(cfg):
        records = {r: [] for r in range(ranks)}
        for step, (T, w) in enumerate(step_timings(cfg, variant, ranks, model, sampler, seed=3), start=1):
            for r in range(ranks):
                records[r].append({"step": step, "start": 100.0 * step, "end": 100.0 * step + T, "cpu": float(w[r]),
                                   "data_cpu": 0.0, "spans": [], "uih_tokens": 0})
        profiled = summarize(decompose(records))["summary"]
        simulated = simulate_steps(cfg, variant, ranks, model, sampler, seed=3)
        assert simulated.straggler_pct == pytest.approx(profiled["straggler_pct"], rel=1e-3)
        assert simulated.exposed_comm_ms == pytest.approx(profiled["exposed_comm_ms_per_step"], abs=2e-3)
        assert simulated.bubble_fraction == pytest.approx(profiled["bubble_fraction"], abs=1e-5)
        assert simulated.step_ms == pytest.approx(profiled["step_ms"], abs=2e-3)


def test_the_balancer_cuts_the_straggler_and_shared_cores_show_as_exposed_time(cpu_box):
    cfg, sampler, model = cpu_box
    baseline, balanced = (simulate_steps(cfg, v, 4, model, sampler) for v in variants(cfg))
    assert balanced.straggler_pct < baseline.straggler_pct / 2
    # 4 ranks on 2 cores: a rank's compute takes about twice its CPU time, which the profiler counts as waiting.
    assert baseline.exposed_comm_ms > 0.5 * (baseline.step_ms - baseline.straggler_pct / 100 * baseline.step_ms) / 2


def test_measured_jitter_steps_are_what_the_ranks_draw():
    # Balanced splits, free exchanges: a step is its slower rank's compute, the faster waits
    # their difference d (a straggler bubble of d / 2 a rank). A step of zero errors is no
    # jitter at all, whatever compute_jitter says; +50% on every rank adds half the mean rank
    # compute m to the step. Steps of one rank's error, {0} and {+50%}, are drawn for each rank
    # apart: the draws differ half the time, and then the difference is m / 2 (about: d is
    # small): d / 4 + m / 8 a rank and step on average. A step of two ranks' errors keeps
    # them together: one rank or the other is m / 2 late in every step, m / 4 on average.
    def figures(steps):
        cfg = load_config(FREESCALE, ["sim.compute_jitter=0.3", "model.user_features=false", "sim.intra_latency_us=0",
                                      "sim.intra_bandwidth_gbs=1e9", f"sim.jitter_steps={steps}"])
        f = simulate_steps(cfg, variants(cfg)[1], 2, CostModel(), LengthSampler(cfg), steps=400)
        return f, f.straggler_pct / 100 * f.step_ms  # the figures, the straggler bubble (ms)

    (exact, split), (zero, _) = figures("[[0, 0]]"), figures("[[0]]")
    assert zero.step_ms == pytest.approx(exact.step_ms, rel=0.02)  # (other batches: other random numbers)
    assert zero.straggler_pct == pytest.approx(exact.straggler_pct, abs=1.0)  # normal draws of 0.3: about 17
    m = exact.step_ms - split
    assert figures("[[0.5, 0.5]]")[0].step_ms == pytest.approx(exact.step_ms + m / 2, rel=0.02)
    assert figures("[[0], [0.5]]")[1] == pytest.approx(split / 2 + m / 8, rel=0.15)
    assert figures("[[0.5, 0]]")[1] == pytest.approx(m / 4, rel=0.15)


def test_the_imbalance_share_and_the_balancers_own_model_set_the_split_straggler():
    # No jitter: a rank's straggler bubble is compute_scale x its cost's shortfall from the
    # most loaded rank's, of which the compute shows imbalance_share; a balancer splitting by
    # a model that sees every sample alike balances counts only, and keeps the length skew.
    def bubble(extra, variant, split_model=None):
        cfg = load_config(FREESCALE, ["sim.compute_jitter=0", "sim.steps=50", *extra])
        f = simulate_steps(cfg, variants(cfg)[variant], 4, CostModel(), LengthSampler(cfg), split_model=split_model)
        return f.straggler_pct / 100 * f.step_ms

    full = bubble([], 0)
    assert full > 0
    assert bubble(["sim.imbalance_share=0.5"], 0) == pytest.approx(full / 2, rel=1e-9)
    assert bubble(["sim.imbalance_share=0"], 0) == 0.0
    by_counts = bubble([], 1, split_model=CostModel(a=0.0, b=0.0, c=0.0, d=1.0))
    assert by_counts > 3 * bubble([], 1)


def test_prioritized_exchanges_expose_only_the_collision_rows():
    cfg = load_config(FREESCALE, ["sim.steps=4", "sim.inter_bandwidth_gbs=0.5", "sim.compute_jitter=0"])
    sampler, model = LengthSampler(cfg), CostModel()
    base, fs = variants(cfg)
    prioritized = {c: simulate_steps(load_config(FREESCALE, ["sim.steps=4", "sim.inter_bandwidth_gbs=0.5",
                                                             f"sim.collision_rate={c}"]), fs, 64, model, sampler)
                   for c in (0.05, 0.5)}
    sparse_dist = simulate_steps(cfg, base, 64, model, sampler)
    assert prioritized[0.05].exposed_comm_ms < prioritized[0.5].exposed_comm_ms < sparse_dist.exposed_comm_ms


def test_overlapped_exchanges_longer_than_the_compute_are_exposed():
    # 2 ranks, 5 ms latency a collective, almost no compute: the baseline's input dist (3
    # all-to-alls, overlapped) cannot hide behind 1 ms of compute; the rows are exposed in
    # full, and the dense all-reduce (2 rounds) beside the gradients' exchange (one): the longer.
    cfg = load_config(FREESCALE, ["sim.steps=3", "sim.compute_scale=1e-12", "sim.step_overhead_ms=1",
                                  "sim.compute_jitter=0", "sim.intra_latency_us=5000", "sim.intra_bandwidth_gbs=1e6",
                                  "model.user_features=false"])
    base, _ = variants(cfg)
    figures = simulate_steps(cfg, base, 2, CostModel(), LengthSampler(cfg))
    assert figures.exposed_comm_ms == pytest.approx((3 * 5 - 1) + 5 + max(2 * 5, 5), abs=0.01)


def test_overlapped_exchanges_take_their_cpu_share_from_busy_cores():
    # 2 ranks on 2 cores, no jitter, 5 ms a collective: the baseline's overlapped input dist
    # (3 all-to-alls, 15 ms) hides behind the compute, but its threads take 2 ms of CPU each
    # from the ranks' cores; both ranks finish 6 ms later, which the profiler sees as waiting.
    # With a core to spare the same threads run beside the ranks and cost nothing.
    def config(cores, share):
        return load_config(FREESCALE, ["sim.steps=2", "sim.compute_jitter=0", "sim.intra_latency_us=5000",
                                       "sim.intra_bandwidth_gbs=1e6", "model.user_features=false",
                                       "sim.ranks_per_host=2", f"sim.cores_per_host={cores}",
                                       f"sim.overlap_cpu_us={share}"])

    sampler = LengthSampler(config(2, 0.0))

    def exposed(cores, share):
        cfg = config(cores, share)
        return simulate_steps(cfg, variants(cfg)[0], 2, CostModel(), sampler).exposed_comm_ms

    assert exposed(2, 2000) - exposed(2, 0) == pytest.approx(3 * 2, abs=0.01)
    assert exposed(4, 2000) == pytest.approx(exposed(4, 0), abs=1e-9)


def test_freescale_simulate_prints_and_writes_the_projection_and_its_chart(tmp_path):
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    proc = freescale("simulate", "--config", FREESCALE, "--sim.ranks=[8,256]", "--sim.steps=3", "--out", str(out),
                     "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the chart the docs show, drawn
    assert "ranks" in proc.stdout and "projections" in proc.stdout
    data = json.loads(out.read_text())
    assert [r["ranks"] for r in data["rows"]] == [8, 256]
    for row in data["rows"]:
        assert row["freescale"]["straggler_pct"] < row["baseline"]["straggler_pct"]
        ett = row["effective_training_time"]
        assert 0 < ett["sync_restart"] <= ett["replica_layer"] <= 1 and math.isfinite(ett["hours_between_failures"])


def test_freescale_simulate_rejects_a_bad_rank_count_in_one_line():
    proc = freescale("simulate", "--config", FREESCALE, "--sim.ranks=[0,8]")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert "sim.ranks" in proc.stderr
