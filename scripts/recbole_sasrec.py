"""One RecBole SASRec run on MovieLens-100K: the peer side of ``scripts/bench_quality.py``.

Runs inside the separate RecBole virtual environment that bench_quality.py creates (RecBole is
never a FreeScale dependency), with that environment's python:

    runs/cache/recbole-venv/bin/python scripts/recbole_sasrec.py --seed 0 --epochs 50 --out sasrec-0.json
        [--max-len 50] [--embedding-dim 64] [--split test_only|valid_and_test]

Protocol (the same as FreeScale's retrieval evaluation):
- each user's interactions in time order, ties in the same second kept in file order (RecBole's
  ``order: TO`` is a stable sort on the timestamp); ``split: {LS: test_only}`` holds out each
  user's last interaction as the test target and trains on everything before it.
  ``valid_and_test`` (second-to-last item for validation, evaluated every epoch) is only for
  choosing the epoch count: it prints and returns the validation curve.
- full ranking of the test target against every item. RecBole's own full-sort evaluation does
  NOT exclude a sequential model's history (``FullSortEvalDataLoader`` returns no history index
  when ``MODEL_TYPE`` is sequential; ``Trainer._full_sort_batch_eval`` then masks only the padding
  item 0), so this driver ranks the scores of ``model.full_sort_predict`` itself with the user's
  other interacted items set to -inf. It also ranks them unmasked and checks that figure against
  RecBole's own ``Trainer.evaluate``, which shows the ranking code agrees with RecBole's.
- metrics from the 0-based rank r of the target (items scoring strictly higher): HR@10 = [r < 10],
  NDCG@10 = [r < 10] / log2(r + 2), MRR = 1 / (r + 1), MRR@10 = [r < 10] / (r + 1), averaged over
  users.

Everything else stays at RecBole's SASRec and overall defaults (2 layers, 2 heads, hidden 64,
inner 256, dropout 0.5, GELU, CE loss over all items, Adam lr 1e-3, batch 2048); the settings
this driver changes are listed under ``changed_settings`` in its JSON. Training time is the wall
time of ``Trainer.fit`` (data loading and evaluation excluded), with each epoch's time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--max-len", type=int, default=50, help="MAX_ITEM_LIST_LENGTH (RecBole's default 50)")
    p.add_argument("--embedding-dim", type=int, default=64, help="SASRec hidden_size (RecBole's default 64)")
    p.add_argument("--batch-size", type=int, default=2048, help="train_batch_size (RecBole's default 2048)")
    p.add_argument("--split", choices=["test_only", "valid_and_test"], default="test_only")
    p.add_argument("--work-dir", default="runs/cache/recbole-work", help="RecBole's checkpoint and log folder")
    p.add_argument("--out", required=True, help="JSON file for the results")
    return p.parse_args(argv)


def rank_metrics(ranks, k: int = 10) -> dict:
    """HR@k, NDCG@k, MRR and MRR@k from 0-based ranks (a 1-D torch tensor), averaged."""
    import torch

    ranks = ranks.double()
    hit = (ranks < k).double()
    return {
        f"hr@{k}": float(hit.mean()),
        f"ndcg@{k}": float((hit / torch.log2(ranks + 2)).mean()),
        "mrr": float((1.0 / (ranks + 1)).mean()),
        f"mrr@{k}": float((hit / (ranks + 1)).mean()),
    }


def user_items(dataset, inter_path: str) -> dict:
    """RecBole's internal user id -> internal ids of every item that user interacted with."""
    import csv

    uid_map = dataset.field2token_id[dataset.uid_field]
    iid_map = dataset.field2token_id[dataset.iid_field]
    items: dict[int, list[int]] = {}
    with open(inter_path) as f:
        rows = csv.reader(f, delimiter="\t")
        header = [h.split(":")[0] for h in next(rows)]
        u, i = header.index("user_id"), header.index("item_id")
        for row in rows:
            items.setdefault(uid_map[row[u]], []).append(iid_map[row[i]])
    return items


def full_rank(model, test_data, items_of_user: dict, uid_field: str) -> tuple:
    """0-based ranks of each test target among all items: (with history masked, unmasked)."""
    import torch

    masked, plain = [], []
    model.eval()
    with torch.no_grad():
        for interaction, _history, _pos_u, positive_i in test_data:
            scores = model.full_sort_predict(interaction).view(len(positive_i), -1)
            scores[:, 0] = -float("inf")  # the padding item, as RecBole masks it
            rows = torch.arange(len(positive_i))
            target = scores[rows, positive_i].clone()
            plain.append((scores > target[:, None]).sum(1))
            for row, uid in enumerate(interaction[uid_field].tolist()):
                scores[row, items_of_user[uid]] = -float("inf")
            scores[rows, positive_i] = target  # the target itself stays ranked
            masked.append((scores > target[:, None]).sum(1))
    return torch.cat(masked), torch.cat(plain)


def main(argv=None) -> int:
    args = parse_args(argv)
    import numpy
    import recbole
    import torch
    from recbole.config import Config
    from recbole.data import create_dataset, data_preparation
    from recbole.model.sequential_recommender import SASRec
    from recbole.trainer import Trainer
    from recbole.utils import init_seed

    os.makedirs(args.work_dir, exist_ok=True)
    args.out = os.path.abspath(args.out)
    # RecBole's Trainer writes TensorBoard files under ./log_tensorboard: keep them out of the checkout.
    os.chdir(args.work_dir)
    data_root = os.path.join(os.path.dirname(recbole.__file__), "dataset_example")
    inter_path = os.path.join(data_root, "ml-100k", "ml-100k.inter")
    changed = {
        "eval_args": {"split": {"LS": args.split}, "group_by": "user", "order": "TO", "mode": "full"},
        "MAX_ITEM_LIST_LENGTH": args.max_len,
        "hidden_size": args.embedding_dim,
        "epochs": args.epochs,
        "train_batch_size": args.batch_size,
        # The CE loss (SASRec's default) scores every item; RecBole refuses a negative sampler with it.
        "train_neg_sample_args": None,
        # Every epoch is trained: the epoch count is fixed, chosen beforehand on the validation curve.
        "stopping_step": args.epochs,
        "seed": args.seed,
        "metrics": ["Hit", "NDCG", "MRR"],
        "topk": [10],
        "valid_metric": "MRR@10",
    }
    plumbing = {"data_path": data_root, "checkpoint_dir": "saved", "use_gpu": False,
                "show_progress": False, "state": "WARNING", "log_wandb": False}
    config = Config(model="SASRec", dataset="ml-100k", config_dict={**changed, **plumbing})
    init_seed(config["seed"], config["reproducibility"])
    dataset = create_dataset(config)
    train_data, valid_data, test_data = data_preparation(config, dataset)
    init_seed(config["seed"] + config["local_rank"], config["reproducibility"])  # as run_recbole does
    model = SASRec(config, train_data._dataset).to(config["device"])
    trainer = Trainer(config, model)

    epochs, curve = [], []
    train_epoch, valid_epoch = trainer._train_epoch, trainer._valid_epoch

    def timed_train_epoch(*a, **kw):
        start = time.perf_counter()
        loss = train_epoch(*a, **kw)
        epochs.append({"epoch": len(epochs), "seconds": time.perf_counter() - start, "train_loss": float(loss)})
        print(f"[sasrec seed {args.seed}] epoch {len(epochs)}/{args.epochs} {epochs[-1]['seconds']:.1f}s "
              f"loss {float(loss):.4f}", file=sys.stderr, flush=True)
        return loss

    def recorded_valid_epoch(*a, **kw):
        score, result = valid_epoch(*a, **kw)
        curve.append({"epoch": len(epochs), **{k: float(v) for k, v in result.items()}})
        print(f"[sasrec seed {args.seed}] valid after epoch {len(epochs)}: "
              + " ".join(f"{k} {float(v):.4f}" for k, v in result.items()), file=sys.stderr, flush=True)
        return score, result

    trainer._train_epoch, trainer._valid_epoch = timed_train_epoch, recorded_valid_epoch
    start = time.perf_counter()
    trainer.fit(train_data, valid_data if args.split == "valid_and_test" else None, saved=False, show_progress=False)
    train_seconds = time.perf_counter() - start

    masked, plain = full_rank(model, test_data, user_items(dataset, inter_path), dataset.uid_field)
    native = {k: float(v) for k, v in trainer.evaluate(test_data, load_best_model=False, show_progress=False).items()}
    unmasked = rank_metrics(plain)
    for ours, theirs in (("hr@10", "hit@10"), ("ndcg@10", "ndcg@10"), ("mrr@10", "mrr@10")):
        if abs(unmasked[ours] - native[theirs]) > 1e-3:
            print(f"recbole_sasrec.py: unmasked {ours} {unmasked[ours]:.4f} disagrees with RecBole's "
                  f"{theirs} {native[theirs]:.4f}", file=sys.stderr)
            return 1
    with open(inter_path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    result = {
        "seed": args.seed,
        "split": args.split,
        "metrics": rank_metrics(masked),
        "metrics_history_not_masked": unmasked,
        "recbole_native_metrics": native,
        "test_users": len(masked),
        "items": int(dataset.item_num - 1),
        "train_samples": len(train_data._dataset),
        "train_seconds": train_seconds,
        "epochs": epochs,
        "valid_curve": curve,
        "changed_settings": changed,
        "torch_threads": torch.get_num_threads(),
        "data": {"path": inter_path, "sha256": digest},
        "versions": {"recbole": recbole.__version__, "torch": torch.__version__, "numpy": numpy.__version__,
                     "python": sys.version.split()[0]},
    }
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
    os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
