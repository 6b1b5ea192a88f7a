"""The CLI end to end with the shipped config."""

import json

import pytest

from helpers.launch import FAST, QUICKSTART, check, freescale

pytestmark = pytest.mark.slow


def test_standalone_single_rank_run(tmp_path):
    run_dir = tmp_path / "solo"
    proc = check(freescale("train", "--config", str(QUICKSTART), *FAST, "--train.steps=3", f"--run.dir={run_dir}",
                           f"--profile.peak_cache={tmp_path / 'gemm_peak.json'}"))
    assert "[r0/0 step 3] loss" in proc.stdout
    assert (run_dir / "config.yaml").exists() and (run_dir / "checkpoints" / "step_00000003").is_dir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ranks"] == 1
    # Model FLOPs counted per step and MFU against the measured peak (stored with the run).
    assert "GFLOP/s | MFU" in proc.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "train/loss" in r]
    assert trained and all(r["train/flop_per_sample"] > 0 and r["train/mfu(%)"] > 0 for r in trained)
    assert summary["efficiency"]["train/mfu(%)"] > 0
    assert json.loads((run_dir / "matmul_peak.json").read_text())["flop_per_s"] > 0


def test_a_failing_run_exits_1_with_one_line_and_the_traceback_in_its_log(tmp_path):
    run_dir = tmp_path / "failing"
    proc = freescale("train", "--config", str(QUICKSTART), *FAST, "--train.steps=3", "--fault.at_step=2",
                     f"--run.dir={run_dir}")
    assert proc.returncode == 1, proc.stderr
    log = run_dir / "logs" / "replica0-rank0.log"
    assert proc.stderr.strip().splitlines() == [
        f"freescale: error: rank 0: InjectedFault: injected fault at step 2 on rank 0 (traceback in {log})"]
    assert "Traceback" not in proc.stdout
    text = log.read_text()
    assert "[r0/0 step 1] loss" in text and "Traceback (most recent call last)" in text
    assert "injected fault at step 2" in text
