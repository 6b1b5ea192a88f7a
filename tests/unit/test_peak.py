"""The measured matmul peak and its cache."""

from __future__ import annotations

import json

import pytest
import torch

from freescale.profile import peak as peak_module
from freescale.profile.peak import matmul_peak, time_matmul

WIDTHS = [(16, 48), (16, 16)]


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _fake_timer(monkeypatch, calls: list):
    def timed(m, k, n, device, repeats=peak_module.REPEATS):
        calls.append((m, k, n))
        return 1e9 * k
    monkeypatch.setattr(peak_module, "time_matmul", timed)


def test_measured_once_then_read_from_the_cache(tmp_path, monkeypatch, one_thread):
    cache = str(tmp_path / "cache" / "gemm_peak.json")
    first = matmul_peak("cpu", WIDTHS, cache, tokens=64)
    assert not first.cached and first.flop_per_s > 0
    assert first.flop_per_s == max(s["flop_per_s"] for s in first.per_shape)
    assert sorted((s["k"], s["n"]) for s in first.per_shape) == sorted(WIDTHS)
    assert first.key["threads"] == 1 and first.key["device"] == "cpu" and first.key["torch"] == torch.__version__

    calls = []
    _fake_timer(monkeypatch, calls)
    again = matmul_peak("cpu", WIDTHS, cache, tokens=64)
    assert again.cached and not calls
    assert again.flop_per_s == first.flop_per_s


def test_a_change_of_key_measures_again_and_keeps_both(tmp_path, monkeypatch, one_thread):
    cache = str(tmp_path / "gemm_peak.json")
    calls = []
    _fake_timer(monkeypatch, calls)
    matmul_peak("cpu", WIDTHS, cache)
    assert len(calls) == 2
    torch.set_num_threads(2)
    matmul_peak("cpu", WIDTHS, cache)  # another thread count
    assert len(calls) == 4
    matmul_peak("cpu", [(16, 32)], cache)  # other widths
    assert len(calls) == 5
    with open(cache) as f:
        assert sorted(e["key"]["threads"] for e in json.load(f).values()) == [1, 2, 2]


def test_an_unreadable_cache_is_measured_again_and_rewritten(tmp_path, monkeypatch):
    cache = tmp_path / "gemm_peak.json"
    cache.write_text('{"cut short')
    calls = []
    _fake_timer(monkeypatch, calls)
    peak = matmul_peak("cpu", WIDTHS, str(cache))
    assert calls and peak.flop_per_s == 48e9 / 3
    assert len(json.loads(cache.read_text())) == 1


def test_timing_is_flops_over_time(monkeypatch):
    """2*m*n*k FLOPs per product over the best repeat's time per product."""
    times = iter([0.001, 0.001, 0.05, 0.04, 0.02, 0.03, 0.05, 0.06])  # two single, warm-up, five repeats

    monkeypatch.setattr(peak_module, "_products_time", lambda a, b, out, count: next(times))
    monkeypatch.setattr(peak_module, "TARGET_S", 0.01)
    # 10 products per timed repeat; the best repeat took 0.02 s.
    assert time_matmul(8, 4, 2, torch.device("cpu")) == pytest.approx(2 * 8 * 4 * 2 * 10 / 0.02)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_peak_is_timed_on_the_device(tmp_path):
    peak = matmul_peak(torch.device("cuda"), WIDTHS, "", tokens=1024)
    assert peak.key["device"] == torch.cuda.get_device_name() and peak.flop_per_s > 0
