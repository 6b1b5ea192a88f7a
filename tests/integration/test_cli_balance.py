"""`freescale balance` and `freescale calibrate` end to end."""

import json

import numpy as np
import pytest

from freescale.balance.cost import CostModel
from helpers.launch import FAST, QUICKSTART, check, freescale, ranks, train_losses


def test_balance_prints_every_partition(tmp_path):
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.pareto(1.1, 8 * 64) * 40 + 1, 2048).astype(np.int64)
    np.save(tmp_path / "lengths.npy", lengths)
    proc = check(freescale("balance", "--lengths", str(tmp_path / "lengths.npy"), "--ranks", "8", "--json", timeout=120))
    result = json.loads(proc.stdout)
    assert set(result) == {"contiguous", "zigzag", "karmarkar_karp", "greedy", "hierarchical", "vbs"}
    costs = CostModel().cost(lengths, np.ones_like(lengths))
    for name, r in result.items():
        assert r["imbalance"] == pytest.approx(r["max_cost"] / r["mean_cost"])
        assert r["mean_cost"] == pytest.approx(costs.sum() / 8)
        assert r["seconds"] >= 0
    assert result["karmarkar_karp"]["imbalance"] < result["contiguous"]["imbalance"]
    table = check(freescale("balance", "--lengths", str(tmp_path / "lengths.npy"), "--ranks", "8",
                            "--partition", "zigzag", timeout=120))
    assert "zigzag" in table.stdout and "karmarkar_karp" not in table.stdout


@pytest.mark.parametrize("setup, args, fragment", [
    (None, ["--lengths", "missing.npy", "--ranks", "2"], "UIH lengths file not found: missing.npy"),
    ([1, 2, 3], ["--ranks", "4"], "--ranks: 4 ranks but only 3 samples"),
    ([1, -2, 3], ["--ranks", "2"], "must be numbers >= 0"),
    ([[1, 2], [3, 4]], ["--ranks", "2"], "expected a 1-D array"),
    ([1, 2, 3], ["--ranks", "2", "--partition", "best"], "--partition: expected one of"),
    ([1, 2, 3], ["--ranks", "2", "--cost-model", "nope.json"], "cost model file not found: nope.json"),
])
def test_balance_errors_exit_2(tmp_path, setup, args, fragment):
    if setup is not None:
        np.save(tmp_path / "l.npy", np.array(setup))
        args = ["--lengths", str(tmp_path / "l.npy"), *args]
    proc = freescale("balance", *args, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and fragment in proc.stderr


@pytest.mark.slow
def test_calibrate_fits_and_training_uses_the_model(tmp_path):
    out = tmp_path / "cost.json"
    proc = check(freescale("calibrate", "--config", str(QUICKSTART), "--out", str(out), "--repeats", "1",
                           "--data.max_uih_len=64", "--model.num_layers=1", timeout=300))
    assert "R^2" in proc.stdout and "[calibrate 1/" in proc.stdout
    model = CostModel.load(str(out))
    assert model.fit["points"] == len(model.fit["grid"]) > 10
    assert min(model.a, model.b, model.c, model.d) >= 0
    # Longer histories cost more, as measured.
    assert model.cost(64, 4) > model.cost(4, 4)

    run_dir = tmp_path / "balanced"
    check(ranks(2, "train", "--config", str(QUICKSTART), *FAST, "--train.steps=4", f"--run.dir={run_dir}",
                   "--balance.enable=true", "--balance.partition=vbs", f"--balance.cost_model={out}"))
    assert sorted(train_losses(run_dir)) == [1, 2, 3, 4]
    assert CostModel.load(str(run_dir / "cost_model.json")) == model
