"""The suite's files run slowest first by their recorded seconds (new files before all), each
file's tests in their own order, under pytest-xdist too, and ``--record-durations`` writes
what each file took, keeping the record of the files it did not run."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from helpers.file_order import file_of, read_record, slowest_first, write_record

TESTS = Path(__file__).resolve().parents[1]


def test_files_run_slowest_first_with_new_files_first_and_each_files_own_order_kept():
    ids = ["u/a.py::x", "u/b.py::y", "u/a.py::z", "u/c.py::w", "u/d.py::v", "u/b.py::t"]
    seconds = {"u/a.py": 5.0, "u/b.py": 50.0, "u/c.py": 5.0}
    got = [ids[i] for i in slowest_first(ids, seconds)]
    # By hand: d (no record), b (50 s), then a and c (5 s each) in the order they were collected.
    assert got == ["u/d.py::v", "u/b.py::y", "u/b.py::t", "u/a.py::x", "u/a.py::z", "u/c.py::w"]
    assert sorted(got) == sorted(ids)


def test_a_record_merges_with_the_files_it_did_not_run_and_is_replaced_whole(tmp_path):
    path = tmp_path / "durations.json"
    assert read_record(path) == {}
    write_record({"t/a.py": 1.26, "t/b.py": 2.0}, path)
    write_record({"t/b.py": 7.04}, path)
    assert json.loads(path.read_text()) == {"t/a.py": 1.3, "t/b.py": 7.0}
    assert [p.name for p in tmp_path.iterdir()] == ["durations.json"]
    assert file_of("t/a.py::test_x[1-2]") == "t/a.py"


def _project(tmp_path):
    """Three test files and a copy of the suite's conftest and file order; each test appends
    its name to ran.txt, so the order the files ran in is seen from outside pytest."""
    root = tmp_path / "proj"
    (root / "helpers").mkdir(parents=True)
    shutil.copy(TESTS / "conftest.py", root / "conftest.py")
    shutil.copy(TESTS / "helpers" / "file_order.py", root / "helpers" / "file_order.py")
    (root / "helpers" / "__init__.py").write_text("")
    (root / "pytest.ini").write_text("[pytest]\n")
    body = "import time\n\ndef test_{n}():\n    time.sleep(0.2)\n    open('ran.txt', 'a').write('{f}::test_{n}\\n')\n"
    for f, count in (("test_a.py", 1), ("test_b.py", 3), ("test_c.py", 2)):
        (root / f).write_text("\n".join(body.format(f=f, n=n) for n in range(count)))
    (root / "file_durations.json").write_text(json.dumps({"test_a.py": 100.0, "test_b.py": 1.0, "gone.py": 9.0}))
    return root


def _pytest(root, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=root,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [line.split("::")[0] for line in (root / "ran.txt").read_text().split()]


def test_under_xdist_the_files_run_in_the_records_order_not_by_their_number_of_tests(tmp_path):
    root = _project(tmp_path)
    # pytest-xdist alone would run b (3 tests), c (2), a (1); the record says c (new), a (100 s), b (1 s).
    ran = _pytest(root, "-n", "1", "--dist", "loadfile", "--record-durations")
    assert ran == ["test_c.py"] * 2 + ["test_a.py"] + ["test_b.py"] * 3
    record = json.loads((root / "file_durations.json").read_text())
    assert set(record) == {"test_a.py", "test_b.py", "test_c.py", "gone.py"} and record["gone.py"] == 9.0
    assert 0.2 <= record["test_a.py"] < 10 and 0.6 <= record["test_b.py"] < 30 and 0.4 <= record["test_c.py"] < 20


def test_without_the_option_no_record_is_written(tmp_path):
    root = _project(tmp_path)
    before = (root / "file_durations.json").read_text()
    assert _pytest(root) == ["test_c.py"] * 2 + ["test_a.py"] + ["test_b.py"] * 3
    assert (root / "file_durations.json").read_text() == before
