"""run.tensorboard: the scalars of metrics.jsonl, step for step, as TensorBoard event files."""

import math
import sys

import pytest

from freescale.config import ConfigError, load_config
from freescale.train.metrics import TENSORBOARD_MISSING
from helpers.launch import FAST, QUICKSTART, check, freescale, metrics


def _jsonl_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Every numeric key of metrics.jsonl and its (step, value) pairs, in file order."""
    series = {}
    for record in metrics(run_dir):
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                series.setdefault(key, []).append((record["step"], float(value)))
    return series


def _event_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """The scalars TensorBoard would show from ``folder`` (purged steps hidden, as it hides them)."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _assert_same(events: dict, jsonl: dict) -> None:
    assert sorted(events) == sorted(jsonl)
    for key, expected in jsonl.items():
        got = events[key]
        assert [s for s, _ in got] == [s for s, _ in expected], key
        for (step, a), (_, b) in zip(got, expected):
            assert (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-30), \
                f"{key} at step {step}: event {a}, metrics.jsonl {b}"


@pytest.mark.slow
def test_event_files_hold_every_scalar_of_metrics_jsonl_also_after_a_resume(tmp_path):
    run_dir = tmp_path / "tb"
    common = ["train", "--config", str(QUICKSTART), *FAST, "--train.steps=4", "--train.eval_every=2",
              "--run.tensorboard=true"]
    check(freescale(*common, "--checkpoint.every=2", f"--run.dir={run_dir}"))
    jsonl = _jsonl_scalars(run_dir)
    assert {"train/loss", "throughput/samples_per_s", "time/step(ms)", "eval/auc", "eval/ne"} <= set(jsonl)
    assert [s for s, _ in jsonl["train/loss"]] == [1, 2, 3, 4] and [s for s, _ in jsonl["eval/auc"]] == [2, 4]
    _assert_same(_event_scalars(run_dir / "tensorboard"), jsonl)

    # Steps 3 and 4 again from step 2's checkpoint: the first launch's records of them are gone
    # from metrics.jsonl and hidden in TensorBoard, each step shows once.
    check(freescale(*common, f"--checkpoint.resume={run_dir / 'checkpoints' / 'step_00000002'}"))
    assert [s for s, _ in _jsonl_scalars(run_dir)["train/loss"]] == [1, 2, 3, 4]
    _assert_same(_event_scalars(run_dir / "tensorboard"), _jsonl_scalars(run_dir))


@pytest.mark.slow
def test_no_tensorboard_folder_when_off(tmp_path):
    run_dir = tmp_path / "plain"
    check(freescale("train", "--config", str(QUICKSTART), *FAST, "--train.steps=2", f"--run.dir={run_dir}"))
    assert metrics(run_dir) and not (run_dir / "tensorboard").exists()


def test_a_missing_tensorboard_package_fails_before_the_run_folder(tmp_path, monkeypatch):
    from freescale.train.trainer import train

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import raises ImportError
    run_dir = tmp_path / "never"
    cfg = load_config(str(QUICKSTART), ["run.tensorboard=true", "run.device=cpu", f"run.dir={run_dir}"])
    with pytest.raises(ConfigError) as err:
        train(cfg)
    assert str(err.value) == TENSORBOARD_MISSING == \
        "run.tensorboard: needs the tensorboard package (pip install tensorboard)"
    assert not run_dir.exists()
