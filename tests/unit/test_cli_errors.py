"""The CLI's bad-input contract: exit status 2 and one line on stderr naming what was wrong."""

import pytest

from helpers.launch import QUICKSTART, freescale


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["train", "--config", str(QUICKSTART), "--no.such=1"], "no.such"),
        (["train", "--config", str(QUICKSTART), "--train.steps=-4"], "train.steps: expected a value >= 1"),
        (["train", "--config", str(QUICKSTART), "--train.lr", "fast"], "train.lr: expected a number"),
        (["train", "--config", "configs/nope.yaml"], "config file not found: configs/nope.yaml"),
        (["train", "--config", str(QUICKSTART), "--data.source=ratings", "--data.ratings.path=missing.csv"],
         "data.ratings.path: file not found: missing.csv"),
        (["train", "--config", str(QUICKSTART), "--verbose"], "unrecognized argument '--verbose'"),
    ],
)
def test_bad_input_exits_2_with_one_line(args, fragment):
    proc = freescale(*args, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("freescale: error: ")
    assert fragment in lines[0]
    assert "Traceback" not in proc.stderr


def test_malformed_yaml_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  name: [unclosed\n")
    proc = freescale("train", "--config", str(bad), timeout=120)
    assert proc.returncode == 2
    assert f"{bad}: malformed YAML at line" in proc.stderr.strip()


def test_config_command_prints_resolved_config_and_keys():
    proc = freescale("config", "--config", str(QUICKSTART), "--train.steps=12", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "steps: 12" in proc.stdout
    keys = freescale("config", "--keys", timeout=120)
    assert keys.returncode == 0
    assert "data.synthetic.tail_alpha = 1.2" in keys.stdout
    assert "Pareto shape of the tail" in keys.stdout
