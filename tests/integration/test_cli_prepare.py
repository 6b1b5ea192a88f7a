"""`freescale prepare` end to end: a dataset written and found up to date the second time, and
bad input refused in one line with exit status 2, leaving nothing at --out (and a dataset that
was there as it was)."""

import json
import os

import pyarrow.parquet as pq
import pytest

from helpers.launch import REPO, check, freescale

CACHE = str(REPO / "runs" / "cache")


def tree(folder):
    """path -> (size, mtime_ns) of every file under ``folder``."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            st = os.stat(os.path.join(root, name))
            out[os.path.relpath(os.path.join(root, name), folder)] = (st.st_size, st.st_mtime_ns)
    return out


def test_ml100k_with_side_features_then_up_to_date(tmp_path):
    out = tmp_path / "ml100k"
    proc = check(freescale("prepare", "--ml100k", "--cache", CACHE, "--out", str(out), "--max-uih-len", "50",
                           "--num-candidates", "10", "--rows-per-file", "5000", timeout=120))
    assert "wrote" in proc.stdout and "943 users, 1682 items" in proc.stdout
    assert "[prepare] 100000 events" in proc.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["labels"] == ["rating>=4"] and manifest["max_uih_len"] == 50
    assert [f["name"] for f in manifest["user_features"]] == ["age", "gender", "occupation"]
    assert [f["name"] for f in manifest["item_features"]] == ["genre", "year"]
    assert manifest["source"]["format"] == "ml100k" and manifest["source"]["users"]["path"].endswith("ml-100k.user")
    items = pq.read_table(out / "items.parquet")
    assert items.column("item_id").to_pylist() == list(range(1682))
    row = pq.read_table(out / manifest["splits"]["train"]["files"][0]["path"]).slice(0, 1).to_pylist()[0]
    assert len(row["user:age"]) == 1 and len(row["user:occupation"]) == 1
    before = tree(out)
    again = check(freescale("prepare", "--format", "ml100k", "--cache", CACHE, "--out", str(out), "--max-uih-len", "50",
                            "--num-candidates", "10", "--rows-per-file", "5000", "--memory-limit", "1GB",
                            "--threads", "1", timeout=120))
    assert "is up to date" in again.stdout and "nothing written" in again.stdout
    assert tree(out) == before  # not one file rewritten
    changed = check(freescale("prepare", "--ml100k", "--cache", CACHE, "--out", str(out), "--max-uih-len", "40",
                              "--num-candidates", "10", "--rows-per-file", "5000", timeout=120))
    assert "wrote" in changed.stdout and json.loads((out / "manifest.json").read_text())["max_uih_len"] == 40
    assert not [p for p in os.listdir(tmp_path) if p != "ml100k"]  # no temporary folder left beside it


def test_synthetic_then_up_to_date(tmp_path):
    out = tmp_path / "syn"
    args = ("prepare", "--synthetic", "5000", "--out", str(out), "--eval-samples", "100", "--max-uih-len", "64",
            "--synthetic.num_items=20000", "--synthetic.median_uih_len", "10")
    check(freescale(*args, timeout=120))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["num_items"] == 20000 and manifest["source"]["synthetic"]["median_uih_len"] == 10.0
    assert (manifest["splits"]["train"]["rows"], manifest["splits"]["eval"]["rows"]) == (5000, 100)
    assert "is up to date" in check(freescale(*args, timeout=120)).stdout


LOG = "user,item,rating,timestamp\nu1,a,5,1\nu1,b,4,2\nu1,c,3,3\nu2,a,5,4\nu2,c,1,5\nu2,b,4,6\n"


@pytest.mark.parametrize("log, args, fragment", [
    (None, ["--input", "missing.csv", "--format", "csv"], "events file not found: missing.csv"),
    (LOG, ["--format", "ml20m"], "no column 'userId', 'movieId' in the header (columns: user, item, rating, timestamp)"),
    ("u,i,r,t\nu1,a,x,1\n", ["--format", "csv", "--columns", "user=u,item=i,rating=r,time=t"],
     "log.csv:2: column r: Could not convert string \"x\" to 'DOUBLE'"),
    (LOG + "u3,a,5\n", ["--format", "csv"], "log.csv:8: Expected Number of Columns: 4 Found: 3"),
    ("", ["--format", "csv"], "log.csv: no events"),
    (LOG + ",a,5,9\n", ["--format", "csv"], "log.csv: event 7 (counting from 1 in the file) has no user id"),
    (LOG, ["--format", "csv", "--min-uih-len", "8", "--max-uih-len", "5"], "--max-uih-len: expected >= --min-uih-len (8)"),
    (LOG, ["--format", "csv", "--window-stride", "2"], "--window-stride: overlapping windows cut timelines for retrieval"),
    (LOG, ["--format", "csv", "--min-uih-len", "5"], "the log yields no ranking train samples"),
    (LOG, ["--format", "csv", "--memory-limit", "lots"], "--memory-limit: 'lots' is not a size DuckDB reads"),
    (LOG, ["--format", "csv", "--users", "nope.user"], "--users: side-feature file not found: nope.user"),
    (LOG, ["--format", "csv", "--columns", "user"], "--columns: expected ROLE=COLUMN pairs"),
    (LOG, ["--format", "csv", "--labels", "is_click"], "--labels: only for --format kuairand"),
    (LOG, [], "--format: required with --input"),
    (None, ["--synthetic", "0"], "--synthetic: expected a number of samples >= 1, got 0"),
    (None, ["--synthetic", "10", "--synthetic.num_items=-1"], "synthetic.num_items: expected a value >= 2"),
])
def test_bad_input_exits_2_in_one_line_and_leaves_nothing(tmp_path, log, args, fragment):
    if log is not None:
        (tmp_path / "log.csv").write_text(log)
        args = ["--input", str(tmp_path / "log.csv"), *args]
    out = tmp_path / "out"
    proc = freescale("prepare", *args, "--out", str(out), timeout=120)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("[prepare]")]
    assert len(errors) == 1 and fragment in errors[0], proc.stderr
    assert errors[0].startswith("freescale: error: ")
    assert sorted(os.listdir(tmp_path)) == (["log.csv"] if log is not None else [])


def test_a_failed_run_leaves_the_previous_dataset_as_it_was(tmp_path):
    log = tmp_path / "log.csv"
    log.write_text(LOG)
    out = tmp_path / "out"
    check(freescale("prepare", "--input", str(log), "--format", "csv", "--out", str(out), "--holdout-fraction", "0.5"))
    before = tree(out)
    log.write_text(LOG + "u3,b,five,9\n")
    proc = freescale("prepare", "--input", str(log), "--format", "csv", "--out", str(out), "--holdout-fraction", "0.5")
    assert proc.returncode == 2 and "log.csv:8: column rating" in proc.stderr
    assert tree(out) == before
    assert sorted(os.listdir(tmp_path)) == ["log.csv", "out"]


def test_out_that_is_not_a_dataset_is_not_replaced(tmp_path):
    (tmp_path / "log.csv").write_text(LOG)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    proc = freescale("prepare", "--input", str(tmp_path / "log.csv"), "--format", "csv", "--out", str(out),
                     "--holdout-fraction", "0.5")
    assert proc.returncode == 2 and "is not a prepared dataset (no manifest.json); not replacing it" in proc.stderr
    assert os.listdir(out) == ["notes.txt"]


def test_engine_out_of_memory_exits_1_in_one_line_and_leaves_nothing(tmp_path):
    proc = freescale("prepare", "--ml100k", "--cache", CACHE, "--out", str(tmp_path / "out"), "--memory-limit", "1MB",
                     "--threads", "1", timeout=120)
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("[prepare]")]
    assert len(errors) == 1 and errors[0].startswith("freescale: error: prepare failed: Out of Memory Error")
    assert "raise --memory-limit" in errors[0]
    assert os.listdir(tmp_path) == []
