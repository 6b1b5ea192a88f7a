"""``freescale verify`` end to end on 2 gloo ranks: two runs that differ fail and name where they
first differ, on either kind of tables; TorchRec's two pipelines train the same numbers. (The
prioritized pipeline against sync, bitwise: ``tests/dist/test_prioritized.py``.)"""

import re

import pytest

from helpers.launch import FAST, QUICKSTART, check, ranks

pytestmark = pytest.mark.slow

KINDS = ("embedding rows", "embedding optimizer state", "dense parameters", "dense optimizer state")


def _verify(*args):
    return ranks(2, "verify", "--config", str(QUICKSTART), *FAST, *args, timeout=600)


def _table(stdout):
    """(step, loss A, loss B, max |diff|) of each row of the printed table."""
    return [(int(r[0]), float(r[1]), float(r[2]), float(r[3])) for r in
            (line.split() for line in stdout.splitlines() if line.strip()[:1].isdigit())]


def _state_diffs(stdout):
    return {kind: float(d) for kind, d in re.findall(r"^(\w[\w ]+):\s+max \|diff\| (\S+)", stdout, re.M)}


def _first_difference(stdout):
    lines = [line for line in stdout.splitlines() if line.startswith("first difference: ")]
    assert len(lines) == 1, stdout
    return lines[0]


def test_runs_that_differ_exit_1_and_name_the_first_step_that_differs():
    # Run B's dense learning rate is another: the first step's loss agrees (no update yet), the second's not.
    proc = _verify("--steps=4", "--set-b", "train.lr=0.01")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "run B (prioritized) with train.lr=0.01" in proc.stdout
    assert "on cpu: NOT bitwise identical" in proc.stdout
    table = _table(proc.stdout)
    assert [row[0] for row in table] == [1, 2, 3, 4]
    assert table[0][3] == 0.0 and table[1][3] > 0
    line = _first_difference(proc.stdout)
    m = re.fullmatch(r"first difference: step 2's loss on rank (\d): (\S+) \(sync\) against (\S+) \(prioritized\)", line)
    assert m, line
    assert float(m[2]) != float(m[3])
    assert all(d > 0 for d in _state_diffs(proc.stdout).values())


def test_torchrec_pipelines_sparse_dist_and_base_train_the_same_numbers():
    proc = check(_verify("--steps=6", "--pipelines=sparse_dist,base"))
    assert "on cpu: bitwise identical" in proc.stdout and "NOT" not in proc.stdout
    assert proc.stdout.count("loss (sparse_dist)") == 1 and proc.stdout.count("loss (base)") == 1
    table = _table(proc.stdout)
    assert len(table) == 6 and all(row[1] == row[2] and row[3] == 0.0 for row in table)
    assert _state_diffs(proc.stdout) == {kind: 0.0 for kind in KINDS}
    assert "first difference" not in proc.stdout and "collision rate" not in proc.stdout


def test_the_snapshot_of_torchrec_tables_sees_their_rows_and_optimizer_state_differ():
    # Run B's tables learn at another rate: its rows, their row-wise Adagrad state and, through
    # the losses, the dense part all move apart from run A's.
    proc = _verify("--steps=3", "--pipelines=sparse_dist,base", "--set-b", "embedding.lr=0.2")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "on cpu: NOT bitwise identical" in proc.stdout
    diffs = _state_diffs(proc.stdout)
    assert set(diffs) == set(KINDS) and all(d > 0 for d in diffs.values()), diffs
    assert re.fullmatch(r"first difference: step 2's loss on rank \d: \S+ \(sparse_dist\) against \S+ \(base\)",
                        _first_difference(proc.stdout))
