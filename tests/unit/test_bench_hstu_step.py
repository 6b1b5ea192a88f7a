"""scripts/bench_hstu_step.py against an older revision: the config keys that revision does not know."""

import importlib.util
import os

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("bench_hstu_step", os.path.join(REPO, "scripts", "bench_hstu_step.py"))
bhs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bhs)


def write(path, data):
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    return str(path)


def test_every_key_the_code_refuses_is_named_and_only_those(tmp_path):
    shipped = yaml.safe_load(open(os.path.join(REPO, "configs", "hstu_ml100k.yaml")))
    shipped["task"]["not_a_key"] = 1
    shipped["model"]["nor_this"] = {"deep": 2}
    config = write(tmp_path / "c.yaml", shipped)
    assert sorted(bhs.unknown_keys(config)) == ["model.nor_this", "task.not_a_key"]
    assert bhs.unknown_keys(os.path.join(REPO, "configs", "hstu_ml100k.yaml")) == []


def test_both_variants_get_the_config_without_what_the_baseline_refuses(tmp_path, monkeypatch):
    # The baseline's probe (a worker in its own tree) is stood in for by its answer.
    config = os.path.join(REPO, "configs", "hstu_ml100k.yaml")
    monkeypatch.setattr(bhs, "worker", lambda tree, args, *extra: {config: ["task.window_stride"]})
    args = type("A", (), {"configs": [config], "baseline": "REV"})()
    assert bhs.common_configs("base", str(tmp_path), args) == {config: ["task.window_stride"]}
    (common,) = args.configs
    data = yaml.safe_load(open(common))
    shipped = yaml.safe_load(open(config))
    assert "window_stride" not in data["task"] and "window_stride" in shipped["task"]
    del shipped["task"]["window_stride"]
    assert data == shipped


def test_a_failing_worker_stops_the_run_with_its_last_line(tmp_path, capsys):
    args = type("A", (), {"batches": 1, "iters": 1, "seed": 0, "threads": 1,
                          "configs": [str(tmp_path / "missing.yaml")]})()
    with pytest.raises(SystemExit) as stop:
        bhs.worker(REPO, args)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "failed" in err[0] and "missing.yaml" in err[0]
