"""Side features end to end, as real torchrun jobs on 2 gloo ranks: TorchRec's pipelined side tables
train bitwise like its synchronous pipeline (ranking and retrieval, evaluations included), a run
resumes bitwise from a checkpoint on both kinds of tables, and a planted feature raises the
held-out AUC. (``freescale verify`` with side features: ``tests/dist/test_prioritized.py``.)"""

import json

import pytest

from helpers.launch import FAST, QUICKSTART, check, freescale, metrics, ranks, train_losses

pytestmark = pytest.mark.slow

SIDE_DATA = ["--data.synthetic.user_features=true", "--data.synthetic.item_features=true"]
# TorchRec's tables take any width; FreeScale's own hold model.embedding_dim (32 here).
TORCHREC_FEATURES = ("--model.side_features=[{name: user:clusters, dim: 8, pooling: mean}, "
                     "{name: item:cluster, dim: 16}]")
OWNED_FEATURES = "--model.side_features=[{name: user:clusters, pooling: mean}, {name: item:cluster, kind: sequence}]"
RETRIEVAL = ["--model.kind=hstu", "--task.kind=retrieval", "--task.num_negatives=8", "--model.user_features=false",
             "--model.side_features=[{name: item:cluster, kind: sequence, dim: 16}]"]


def _logged(run_dir):
    """The run's metrics lines without its timings."""
    return [{k: v for k, v in r.items() if not k.startswith(("throughput", "time", "train/tflops", "train/mfu"))}
            for r in metrics(run_dir)]


@pytest.mark.parametrize("extra", [[TORCHREC_FEATURES], [TORCHREC_FEATURES, "--model.kind=hstu"], RETRIEVAL],
                         ids=["transformer", "hstu-ranking", "hstu-retrieval"])
def test_torchrec_s_pipelined_side_tables_train_bitwise_like_its_synchronous_pipeline(tmp_path, extra):
    # sparse_dist starts the side features' input distribution a batch ahead; base runs it in place.
    runs = {}
    for pipeline in ("sparse_dist", "base"):
        run_dir = tmp_path / pipeline
        check(ranks(2, "train", "--config", str(QUICKSTART), *FAST, *SIDE_DATA, *extra, "--train.steps=5",
                       "--train.eval_every=3", "--checkpoint.at_end=false", f"--train.pipeline={pipeline}",
                       f"--run.dir={run_dir}"))
        runs[pipeline] = _logged(run_dir)
    evals = [r for r in runs["base"] if any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in evals] == [3, 5]
    assert ("eval/hr@10" if "--task.kind=retrieval" in extra else "eval/auc") in evals[0]
    assert runs["sparse_dist"] == runs["base"]


@pytest.mark.parametrize("pipeline,features", [("sparse_dist", TORCHREC_FEATURES), ("prioritized", OWNED_FEATURES)])
def test_a_run_with_side_features_resumes_bitwise_from_a_checkpoint_taken_mid_run(tmp_path, pipeline, features):
    # The side tables, their optimizer state and the join's projections are in the checkpoint.
    chosen = [*SIDE_DATA, features, f"--train.pipeline={pipeline}", "--train.steps=5", "--checkpoint.every=2",
              "--checkpoint.keep=3"]
    run_dir = tmp_path / "mid"
    check(ranks(2, "train", "--config", str(QUICKSTART), *FAST, *chosen, f"--run.dir={run_dir}"))
    before = train_losses(run_dir)
    final = [r for r in metrics(run_dir) if "eval/auc" in r][-1]
    check(ranks(2, "train", "--config", str(QUICKSTART), *FAST, *chosen,
                   f"--checkpoint.resume={run_dir / 'checkpoints' / 'step_00000002'}"))
    assert [r["step"] for r in metrics(run_dir) if "train/loss" in r] == [1, 2, 3, 4, 5]
    assert train_losses(run_dir) == before
    assert [r for r in metrics(run_dir) if "eval/auc" in r][-1]["eval/auc"] == final["eval/auc"]
    saved = (run_dir / "checkpoints" / "step_00000002" / ".metadata").read_bytes()
    assert b"user_clusters_table" in saved and b"item_cluster_table" in saved and b"task.join." in saved


def test_the_planted_side_features_raise_the_held_out_auc(tmp_path):
    """The synthetic click depends on whether the candidate's cluster is one the user prefers;
    with short histories the model hardly sees it, and user:clusters with item:cluster state it
    (one process, 60 steps: about 20 s a run)."""
    small = ["--data.batch_size=32", "--data.max_uih_len=4", "--data.eval_samples=512", "--model.num_layers=1",
             "--model.embedding_dim=16", "--model.mlp_dims=[16]", "--train.steps=60", "--train.eval_every=0",
             "--checkpoint.at_end=false", "--profile.enable=false", "--run.log_every=20"]
    auc = {}
    for name, extra in (("without", []), ("with", [*SIDE_DATA, "--model.side_features=[{name: user:clusters}, "
                                                               "{name: item:cluster}]"])):
        run_dir = tmp_path / name
        check(freescale("train", "--config", str(QUICKSTART), *small, *extra, f"--run.dir={run_dir}"))
        auc[name] = json.loads((run_dir / "summary.json").read_text())["eval/auc"]
    assert auc["with"] > auc["without"] + 0.03, auc
