"""HSTU's padded serving forms (``freescale.serve.hstu_dense``) against the training forward, and
their ``torch.export`` programs."""

import pytest
import torch

from freescale.config import ModelConfig, TaskConfig
from freescale.model.hstu_tasks import HSTURankingTask, HSTURetrievalTask
from freescale.serve.hstu_dense import ServingHSTUQuery, ServingHSTURanking
from freescale.serve.standalone import _padded

TOLERANCE = 1e-5  # logits and query vectors, padded (serving) against jagged (training), fp32
MAX_UIH = 40
# Mixed lengths: short ones, one past a ladder rung, tails at and near the maximum, one token.
LENGTHS = [3, 1, 17, 40, 5, 2, 33, 8]
COUNTS = [2, 1, 4, 3, 1, 2, 4, 2]


def _cfg(user_features=True, d_model=0):
    return ModelConfig(kind="hstu", embedding_dim=16, d_model=d_model, num_layers=2, num_heads=2, mlp_dims=[8],
                       user_features=user_features, attention_padding=1.25, num_time_buckets=16, dropout=0.1)


def _inputs(uih_lengths, cand_counts, dim=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    uih_lengths, cand_counts = torch.tensor(uih_lengths), torch.tensor(cand_counts)
    nu, nc = int(uih_lengths.sum()), int(cand_counts.sum())
    # Increasing seconds per history with gaps from seconds to months (many time buckets).
    gaps = (10 ** (torch.rand(nu, generator=g) * 7)).long()
    uih_ts = 1_600_000_000 + torch.cumsum(gaps, 0)
    cand_ts = int(uih_ts.max()) + torch.randint(0, 10**6, (nc,), generator=g)
    return dict(uih=torch.randn(nu, dim, generator=g), uih_lengths=uih_lengths, uih_timestamps=uih_ts,
                cand=torch.randn(nc, dim, generator=g), cand_counts=cand_counts, cand_timestamps=cand_ts,
                user=torch.randn(len(uih_lengths), dim, generator=g), item_ids=torch.randint(0, 50, (nu + nc,), generator=g))


def _train_forward(task, x, num_labels=1):
    nc = int(x["cand_counts"].sum())
    return task(x["uih"], x["cand"], x["user"] if task.cfg.user_features else None, x["item_ids"], x["uih_lengths"],
                x["cand_counts"], x["uih_timestamps"], x["cand_timestamps"], torch.zeros(nc, num_labels),
                torch.arange(len(x["uih_lengths"])), torch.tensor(0), torch.tensor(1.0))[1]


def _padded_args(x, ranking=True):
    L = max(2, int(x["uih_lengths"].max()))
    args = [_padded(x["uih"], x["uih_lengths"], L), x["uih_lengths"], _padded(x["uih_timestamps"], x["uih_lengths"], L)]
    if ranking:
        C = max(2, int(x["cand_counts"].max()))
        args += [_padded(x["cand"], x["cand_counts"], C), x["cand_counts"],
                 _padded(x["cand_timestamps"], x["cand_counts"], C), x["user"]]
    return args


def _ranking_task(user_features=True, d_model=0, num_labels=2):
    torch.manual_seed(0)
    return HSTURankingTask(_cfg(user_features, d_model), max_len=MAX_UIH + 4, num_labels=num_labels).eval()


def _ranking_logits(dense, x):
    logits = dense(*_padded_args(x))
    return logits[torch.arange(logits.shape[1])[None, :] < x["cand_counts"][:, None]]


@pytest.mark.parametrize("user_features, d_model", [(True, 0), (False, 0), (True, 24)])
def test_the_padded_hstu_ranking_computes_what_training_does(user_features, d_model):
    task = _ranking_task(user_features, d_model)
    x = _inputs(LENGTHS, COUNTS)
    with torch.no_grad():
        want = _train_forward(task, x, 2).logits
        got = _ranking_logits(ServingHSTURanking(task).eval(), x)
    assert got.shape == want.shape == (sum(COUNTS), 2)
    assert float((got - want).abs().max()) <= TOLERANCE


def test_the_exported_hstu_ranking_program_takes_other_sizes(tmp_path):
    from freescale.serve.export import export_dense

    task = _ranking_task()
    export_dense(task, str(tmp_path / "dense.pt2"))
    program = torch.export.load(str(tmp_path / "dense.pt2")).module()
    for lengths, counts in ((LENGTHS, COUNTS), ([1], [1]), ([2, 39, 4], [4, 1, 3])):
        x = _inputs(lengths, counts, seed=len(lengths))
        with torch.no_grad():
            want = _train_forward(task, x, 2).logits
            got = _ranking_logits(program, x)
        assert float((got - want).abs().max()) <= TOLERANCE, (lengths, counts)


def _retrieval_task(d_model=0):
    torch.manual_seed(0)
    return HSTURetrievalTask(_cfg(False, d_model), TaskConfig(kind="retrieval"), max_len=MAX_UIH).eval()


@pytest.mark.parametrize("d_model", [0, 24])
def test_the_padded_user_tower_computes_the_training_query(d_model):
    task = _retrieval_task(d_model)
    x = _inputs([*LENGTHS, 0], [*COUNTS, 2])  # an empty history: a zero query, as in training
    with torch.no_grad():
        want = _train_forward(task, x).queries
        got = ServingHSTUQuery(task).eval()(*_padded_args(x, ranking=False))
    assert got.shape == want.shape == (len(LENGTHS) + 1, 16)
    assert float((got - want).abs().max()) <= TOLERANCE
    assert float(got[-1].abs().max()) == 0.0


def test_the_exported_user_tower_takes_other_sizes(tmp_path):
    from freescale.serve.export import export_dense

    task = _retrieval_task()
    export_dense(task, str(tmp_path / "dense.pt2"))
    program = torch.export.load(str(tmp_path / "dense.pt2")).module()
    for lengths in (LENGTHS, [1], [0, 5]):
        x = _inputs(lengths, [2] * len(lengths), seed=len(lengths))
        with torch.no_grad():
            want = _train_forward(task, x).queries
            got = program(*_padded_args(x, ranking=False))
        assert float((got - want).abs().max()) <= TOLERANCE, lengths
