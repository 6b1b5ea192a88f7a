"""Exactly-once training, read from the ledger, and clean-up after a failure: ``train()`` on 2
gloo ranks, in-process, several runs per process."""

import gc
import threading

import pytest

from freescale.config import load_config
from freescale.train.ledger import audit, expected_samples, read_ledger
from helpers.launch import FAST, QUICKSTART, metrics
from helpers.prepared import batches_of, train_ids, write_synthetic_prepared
from helpers.spawn import run_ranks

pytestmark = pytest.mark.slow

PARTITIONS = ["contiguous", "zigzag", "karmarkar_karp", "greedy", "vbs", "hierarchical"]
BALANCED = [*FAST, "--train.ledger=true", "--balance.enable=true", "--profile.enable=true",
            "--profile.warmup_steps=1", "--data.synthetic.tail_prob=0.2", "--run.threads=1"]


expected_batches = expected_samples


def _every_partition(rank, world, root):
    from freescale.train.trainer import train

    for partition in PARTITIONS:
        cfg = load_config(QUICKSTART, [*BALANCED, f"--balance.partition={partition}", "--train.steps=3",
                                       f"--run.dir={root}/{partition}"])
        assert train(cfg)["steps_this_launch"] == 3


def test_every_partition_trains_each_sample_exactly_once(tmp_path):
    run_ranks(2, _every_partition, str(tmp_path))
    cfg = load_config(QUICKSTART, BALANCED)
    expected = expected_batches(cfg, range(3), ranks=2)
    for partition in PARTITIONS:
        records = read_ledger(tmp_path / partition)
        assert sorted((r["step"], r["rank"]) for r in records) == [(s, r) for s in (1, 2, 3) for r in (0, 1)]
        assert audit(records, expected) == {"samples_lost": 0, "samples_repeated": 0, "unexpected": 0}, partition
        moved = any(r["sample_ids"] != expected[r["batch"]][r["rank"] * 16:(r["rank"] + 1) * 16] for r in records)
        assert moved == (partition != "contiguous"), partition  # the balancer did re-partition


def _crash_and_resume(rank, world, root, data=()):
    from freescale.faults import InjectedFault
    from freescale.train.trainer import TrainingError, train

    threads_before = {t.name for t in threading.enumerate()}
    run = [*BALANCED, "--balance.partition=karmarkar_karp", "--transport.kind=host_staged", "--train.steps=6",
           "--checkpoint.every=2", f"--run.dir={root}", *data]
    # Steps 1-5 train (checkpoints at 2 and 4, the balancer a batch ahead), then the run fails.
    with pytest.raises(TrainingError, match="InjectedFault: injected fault at step 6") as err:
        train(load_config(QUICKSTART, [*run, "--fault.at_step=6"]))
    assert isinstance(err.value.__cause__, InjectedFault)
    # Everything the run opened is closed: GC schedule, transport proxy, log file.
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert not [t for t in threading.enumerate() if t.name.startswith(("host-staged-proxy", "freescale-read-ahead"))]
    assert {t.name for t in threading.enumerate()} <= threads_before | {"MainThread"}
    from freescale.logging import get_logger
    assert [type(h).__name__ for h in get_logger().handlers] == ["StreamHandler"]
    assert "Traceback" in open(err.value.log_path).read()
    # Resume from the latest checkpoint (step 4): steps 5 and 6 train again, once each.
    summary = train(load_config(QUICKSTART, [*run, f"--checkpoint.resume={root}"]))
    assert summary["steps_this_launch"] == 2 and summary["first_step"] == 5


def test_resume_after_a_crash_trains_no_sample_twice(tmp_path):
    run_ranks(2, _crash_and_resume, str(tmp_path))
    cfg = load_config(QUICKSTART, BALANCED)
    records = read_ledger(tmp_path)
    assert sorted((r["step"], r["rank"]) for r in records) == [(s, r) for s in range(1, 7) for r in (0, 1)]
    assert audit(records, expected_batches(cfg, range(6), ranks=2)) == {
        "samples_lost": 0, "samples_repeated": 0, "unexpected": 0}
    assert [r["step"] for r in metrics(tmp_path) if "train/loss" in r] == [1, 2, 3, 4, 5, 6]  # step 5 rewound


def _crash_and_resume_on_parquet(rank, world, root, data):
    _crash_and_resume(rank, world, root, ["--data.source=parquet", f"--data.path={data}"])


def test_resume_on_prepared_parquet_data_trains_no_sample_twice(tmp_path):
    # 150 samples: the 6 steps of 32 wrap into the second epoch, across row groups and files.
    data = write_synthetic_prepared(tmp_path / "data", QUICKSTART, BALANCED, n_train=150)
    run_ranks(2, _crash_and_resume_on_parquet, str(tmp_path / "run"), data)
    records = read_ledger(tmp_path / "run")
    assert sorted((r["step"], r["rank"]) for r in records) == [(s, r) for s in range(1, 7) for r in (0, 1)]
    expected = batches_of(train_ids(data), range(6), global_batch=32)
    assert audit(records, expected) == {"samples_lost": 0, "samples_repeated": 0, "unexpected": 0}
    assert [r["step"] for r in metrics(tmp_path / "run") if "train/loss" in r] == [1, 2, 3, 4, 5, 6]
