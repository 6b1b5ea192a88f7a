"""scripts/bench_quality.py's own arithmetic and command-line checks (no training, no RecBole)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "bench_quality.py")
_spec = importlib.util.spec_from_file_location("bench_quality", SCRIPT)
bq = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bq)
# A config that ships: the argument checks below are about arguments, not the HSTU config's arrival.
EXISTING_CONFIG = "configs/ml100k.yaml"


def _run(hr, ndcg, mrr, mrr10, seconds):
    return {"metrics": {"hr@10": hr, "ndcg@10": ndcg, "mrr": mrr, "mrr@10": mrr10}, "train_s": seconds}


RUNS = {
    "sasrec": {"0": _run(0.10, 0.05, 0.04, 0.03, 100.0), "1": _run(0.12, 0.06, 0.05, 0.04, 110.0),
               "2": _run(0.14, 0.07, 0.06, 0.05, 120.0)},
    "hstu": {"0": _run(0.15, 0.09, 0.07, 0.06, 50.0), "1": _run(0.18, 0.06, 0.08, 0.07, 40.0),
             "2": _run(0.21, 0.09, 0.09, 0.08, 60.0)},
}


def test_summary_means_ranges_and_ratio():
    s = bq.summarize(RUNS)
    assert s["sasrec"]["hr@10"] == pytest.approx({"mean": 0.12, "min": 0.10, "max": 0.14})
    assert s["hstu"]["train_s"] == pytest.approx({"mean": 50.0, "min": 40.0, "max": 60.0})
    assert s["ratio_hstu_over_sasrec"] == pytest.approx({"hr@10": 0.18 / 0.12, "ndcg@10": 0.08 / 0.06})


def test_epoch_times_and_validation_curve_are_reported():
    runs = {"sasrec": {"0": {**_run(0.1, 0.05, 0.04, 0.03, 30.0), "epoch_s": [10.0, 20.0], "valid_mrr@10": [0.01, 0.02]},
                       "1": {**_run(0.1, 0.05, 0.04, 0.03, 30.0), "epoch_s": [15.0, 15.0], "valid_mrr@10": [0.01, 0.03]}}}
    s = bq.summarize(runs)
    assert s["sasrec"]["epoch_s"] == pytest.approx({"mean": 15.0, "min": 10.0, "max": 20.0})
    table = bq.format_table(runs, s)
    assert "sasrec seed 1 validation MRR@10 by epoch: 0.0100 0.0300  (still rising: NOT converged)" in table
    assert "sasrec seconds per epoch: 15.0 (10.0..20.0)" in table


def test_one_model_has_no_ratio():
    s = bq.summarize({"sasrec": RUNS["sasrec"]})
    assert "ratio_hstu_over_sasrec" not in s and "hstu" not in s


def test_table_lists_each_seed_the_mean_and_the_ratio():
    table = bq.format_table(RUNS, bq.summarize(RUNS))
    assert table.count("\nsasrec ") == 4 and table.count("\nhstu ") == 4
    assert "0.1200 (0.1000..0.1400)" in table
    assert "hr@10 1.500x" in table and "ndcg@10 1.333x" in table


def test_json_round_trips_and_is_reusable(tmp_path, monkeypatch):
    monkeypatch.setattr(bq, "HSTU_CONFIG", EXISTING_CONFIG)
    args = bq.parse_args(["--seeds", "0", "1", "2", "--only", "sasrec", "--out", str(tmp_path / "q.json")])
    doc = bq.result_document(args, {"sasrec": RUNS["sasrec"]}, {"shared": bq.SETTINGS, "sasrec": {"epochs": 5}},
                             {"python": "3"}, ["scripts/bench_quality.py", "--only", "sasrec"])
    path = tmp_path / "q.json"
    bq.write_json_atomic(str(path), doc)
    back = json.loads(path.read_text())
    assert back["summary"]["sasrec"]["mrr"]["mean"] == pytest.approx(0.05)
    assert back["command"] == "scripts/bench_quality.py --only sasrec"
    reused = bq.parse_args(["--seeds", "0", "2", "--reuse-sasrec", str(path), "--out", str(tmp_path / "b.json")])
    assert sorted(reused.reused["runs"]) == ["0", "2"]


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "-1"], "--seeds: seeds must be >= 0"),
    (["--seeds", "1", "1"], "--seeds: each seed once"),
    (["--seeds", "x"], "invalid int value"),
    (["--only", "bert4rec"], "invalid choice"),
    (["--sasrec-epochs", "0"], "--sasrec-epochs: expected >= 1"),
    (["--reuse-sasrec", "/nonexistent.json"], "--reuse-sasrec: cannot read"),
    (["--reuse-sasrec", "x.json", "--only", "sasrec"], "nothing would run"),
    (["--out", "/nonexistent/dir/q.json"], "--out: folder"),
])
def test_bad_arguments_fail_in_one_line(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(bq, "HSTU_CONFIG", EXISTING_CONFIG)
    assert bq.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bench_quality.py: error: ") and message in err


def test_a_missing_hstu_config_is_named(monkeypatch, capsys):
    monkeypatch.setattr(bq, "HSTU_CONFIG", "configs/no_such.yaml")
    assert bq.main(["--only", "hstu"]) == 2
    assert "configs/no_such.yaml (FreeScale's HSTU retrieval config) does not exist" in capsys.readouterr().err
    assert bq.parse_args(["--only", "sasrec"]).only == "sasrec"


def test_reuse_needs_every_seed(tmp_path, monkeypatch):
    monkeypatch.setattr(bq, "HSTU_CONFIG", EXISTING_CONFIG)
    path = tmp_path / "q.json"
    path.write_text(json.dumps({"settings": {"shared": bq.SETTINGS}, "runs": {"sasrec": {"0": RUNS["sasrec"]["0"]}}}))
    assert bq.main(["--seeds", "0", "1", "--reuse-sasrec", str(path)]) == 2


def test_command_line_exit_status():
    proc = subprocess.run([sys.executable, SCRIPT, "--only", "nope"], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1


def test_convergence_is_read_from_the_validation_curve():
    assert bq.converged([0.01, 0.05, 0.08]) is False
    assert bq.converged([0.05, 0.080, 0.0801]) is True
    assert bq.converged([0.05, 0.09, 0.08]) is True
    assert bq.converged([0.05]) is None


def test_hstu_run_command_and_summary(tmp_path):
    cmd = bq.hstu_command(3, str(tmp_path))
    assert cmd[1:] == ["-m", "freescale", "train", "--config", "configs/hstu_ml100k.yaml", "--run.seed=3",
                       f"--run.out_dir={tmp_path}"]
    run = tmp_path / "hstu_ml100k-20260101-000000"
    run.mkdir()
    figures = {"eval/hr@10": 0.2, "eval/ndcg@10": 0.1, "eval/mrr": 0.09, "eval/mrr@10": 0.08, "wall_s": 70.0}
    (run / "summary.json").write_text(json.dumps(figures))
    got = bq.read_hstu_summary(str(tmp_path), 3)
    assert got["metrics"] == {"hr@10": 0.2, "ndcg@10": 0.1, "mrr": 0.09, "mrr@10": 0.08}
    assert (got["train_s"], got["train_s_source"]) == (70.0, "wall_s")
    (run / "summary.json").write_text(json.dumps({**figures, "train_s": 60.0}))
    assert bq.read_hstu_summary(str(tmp_path), 3)["train_s"] == 60.0
    (run / "summary.json").write_text(json.dumps({"eval/hr@10": 0.2}))
    with pytest.raises(RuntimeError, match="lacks"):
        bq.read_hstu_summary(str(tmp_path), 3)
