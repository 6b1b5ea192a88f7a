"""Real jobs on 2 gloo ranks (``freescale train --nproc 2``, and plain torchrun): training, checkpoint
resume, the ratings reader end to end."""

import json
import math

import pytest

from freescale.config import load_config
from helpers.launch import FAST, QUICKSTART, check, metrics, ranks, torchrun, train_losses

pytestmark = pytest.mark.slow


def run(tmp_path, name, *extra, nproc=2):
    run_dir = tmp_path / name
    check(ranks(nproc, "train", "--config", str(QUICKSTART), *FAST, f"--run.dir={run_dir}", *extra))
    return run_dir


# The prioritized run checkpoints at steps 2, 4 and 6: a drain before each, which must not
# change its numbers (the resume test compares a run without them against it).
STRAIGHT = {"sparse_dist": ["--train.steps=6", "--train.pipeline=sparse_dist"],
            "prioritized": ["--train.steps=6", "--train.pipeline=prioritized", "--checkpoint.every=2",
                            "--checkpoint.keep=3"]}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted 6-step run of each pipeline, made once for the tests that read it: its
    folder, and its losses and last evaluation as it finished (a test may resume in it later)."""
    made = {}

    def get(pipeline):
        if pipeline not in made:
            run_dir = run(tmp_path_factory.mktemp("straight"), pipeline, *STRAIGHT[pipeline])
            made[pipeline] = run_dir, train_losses(run_dir), [r for r in metrics(run_dir) if "eval/auc" in r][-1]
        return made[pipeline]

    return get


def test_two_rank_training_writes_its_run_folder(straight):
    run_dir, _, _ = straight("sparse_dist")
    losses = train_losses(run_dir)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(x) and x > 0 for x in losses.values())
    evals = [r for r in metrics(run_dir) if "eval/auc" in r]
    assert len(evals) == 1 and evals[0]["step"] == 6 and 0.0 <= evals[0]["eval/auc"] <= 1.0
    assert (run_dir / "checkpoints" / "step_00000006" / ".metadata").exists()
    assert not any(p.name.startswith(".tmp") for p in (run_dir / "checkpoints").iterdir())
    written = load_config(run_dir / "config.yaml")
    assert written.train.steps == 6 and written.run.dir == str(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["ranks"] == 2


@pytest.mark.parametrize("pipeline", ["sparse_dist", "prioritized"])
def test_resume_trains_only_the_remaining_steps_from_the_checkpoint(tmp_path, straight, pipeline):
    # The prioritized pipeline drains its deferred updates into the tables before a checkpoint,
    # and saves them as row-sharded DTensors; a resumed run goes on bit for bit alike too.
    chosen = f"--train.pipeline={pipeline}"
    _, expected, last_eval = straight(pipeline)
    first = run(tmp_path, "first", "--train.steps=3", chosen)
    # The resumed launch is plain torchrun's (each rank a fresh process), the others forked by
    # --nproc: the two ways to start ranks train alike, bit for bit.
    proc = check(torchrun(2, "train", "--config", str(QUICKSTART), *FAST, "--train.steps=6", chosen,
                          f"--checkpoint.resume={first}"))
    assert f"resumed from {first}/checkpoints/step_00000003 at step 3" in proc.stdout
    assert "ShardedTensor" not in proc.stderr, proc.stderr[-2000:]  # (DCP's warning at each of TorchRec's tables)
    summary = json.loads((first / "summary.json").read_text())
    assert summary["steps_this_launch"] == 3 and summary["first_step"] == 4 and summary["steps"] == 6
    # Exactly one loss line per step: the resumed launch did not train steps 1-3 again.
    steps = [r["step"] for r in metrics(first) if "train/loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]
    # Bitwise: same model, optimizer state, data cursor and RNG as the uninterrupted run; step 4's
    # loss is the resumed weights' loss on batch 4 (a fresh model would not give it).
    resumed = train_losses(first)
    assert [resumed[s] for s in range(1, 7)] == [expected[s] for s in range(1, 7)]
    assert [r for r in metrics(first) if "eval/auc" in r][-1]["eval/auc"] == last_eval["eval/auc"]
    assert sorted(p.name for p in (first / "checkpoints").iterdir()) == ["step_00000003", "step_00000006"]


def test_checkpoints_are_pruned_and_an_older_one_resumes(tmp_path):
    every = run(tmp_path, "every", "--train.steps=5", "--checkpoint.every=1", "--checkpoint.keep=2")
    assert sorted(p.name for p in (every / "checkpoints").iterdir()) == ["step_00000004", "step_00000005"]
    before = train_losses(every)
    # Resume from one checkpoint folder, not the latest: step 5 is trained again, in place.
    older = every / "checkpoints" / "step_00000004"
    check(ranks(2, "train", "--config", str(QUICKSTART), *FAST, "--train.steps=5", "--checkpoint.every=1",
                   "--checkpoint.keep=2", f"--checkpoint.resume={older}"))
    assert json.loads((every / "summary.json").read_text())["steps_this_launch"] == 1
    assert [r["step"] for r in metrics(every) if "train/loss" in r] == [1, 2, 3, 4, 5]
    assert train_losses(every) == before
    assert sorted(p.name for p in (every / "checkpoints").iterdir()) == ["step_00000004", "step_00000005"]


def test_a_prioritized_run_resumes_bitwise_from_a_checkpoint_taken_mid_run(straight):
    # No evaluation at step 2: only the drain before the checkpoint puts batch 2's deferred
    # updates (rows batch 3 does not read) into the saved tables.
    run_dir, before, _ = straight("prioritized")
    check(ranks(2, "train", "--config", str(QUICKSTART), *FAST, *STRAIGHT["prioritized"],
                   f"--checkpoint.resume={run_dir / 'checkpoints' / 'step_00000002'}"))
    assert [r["step"] for r in metrics(run_dir) if "train/loss" in r] == [1, 2, 3, 4, 5, 6]
    assert train_losses(run_dir) == before


def test_ratings_log_trains_with_the_base_pipeline(tmp_path):
    rows = []
    for u in range(40):
        for t in range(12):
            item = (u * 7 + t * 3) % 50
            rows.append(f"{u}::{item}::{1 + (u + item) % 5}::{1000 + 13 * t + u}")
    path = tmp_path / "ratings.dat"
    path.write_text("\n".join(rows) + "\n")
    run_dir = run(tmp_path, "ratings", "--data.source=ratings", f"--data.ratings.path={path}", "--train.steps=4",
                  "--train.pipeline=base", "--data.num_candidates=2")
    assert sorted(train_losses(run_dir)) == [1, 2, 3, 4]
    assert [r for r in metrics(run_dir) if "eval/auc" in r][0]["eval/samples"] > 0
