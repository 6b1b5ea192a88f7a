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
                       user_features=user_features, attention_padding=1.25, num_time_buckets=64, dropout=0.1)


def _inputs(uih_lengths, cand_counts, dim=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    uih_lengths, cand_counts = torch.tensor(uih_lengths), torch.tensor(cand_counts)
    nu, nc = int(uih_lengths.sum()), int(cand_counts.sum())
    # Increasing seconds per history, gaps from 1 s to 30 years: time buckets 0 to past the
    # 64th (clamped), so every bucket's weight and the clamp take part.
    gaps = (10 ** (torch.rand(nu, generator=g) * 9)).long()
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


def _with_strong_bias(task):
    """``task`` with its relative position and time weights drawn at std 1 (initialized at 0.02,
    they move the logits by less than the tolerance, so a wrong mask, bucket or position would
    go unseen; trained ones are larger)."""
    with torch.no_grad():
        for layer in task.encoder.layers:
            layer.bias.position_weight.normal_(std=1.0)
            layer.bias.time_weight.normal_(std=1.0)
    return task


def _ranking_task(user_features=True, d_model=0, num_labels=2):
    torch.manual_seed(0)
    return _with_strong_bias(HSTURankingTask(_cfg(user_features, d_model), max_len=MAX_UIH + 4,
                                             num_labels=num_labels)).eval()


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
    return _with_strong_bias(HSTURetrievalTask(_cfg(False, d_model), TaskConfig(kind="retrieval"),
                                               max_len=MAX_UIH)).eval()


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


# --- Whole exports (tables quantized, program, serve.py) of freshly initialized HSTU models ---

HSTU_OVERRIDES = ["model.embedding_dim=16", "model.num_layers=2", "model.num_heads=2", "model.mlp_dims=[8]",
                  "model.user_hash_size=50", "model.num_time_buckets=64", "data.max_uih_len=64",
                  "data.synthetic.num_items=300", "data.eval_samples=256", "data.batch_size=64",
                  "data.synthetic.median_uih_len=12", "data.synthetic.tail_min_len=40"]


def _in_memory_export(tmp_path, overrides, quantize="fp32", name=None):
    """An export of a freshly initialized model of ``configs/hstu_ranking.yaml`` with
    ``overrides`` (no checkpoint), and the model it came from."""
    from freescale.config import load_config
    from freescale.model.seqrec import build_task, task_settings
    from freescale.serve.bench import load_export
    from freescale.serve.export import Trained, trained_model, write_export
    from helpers.launch import REPO

    cfg = load_config(REPO / "configs" / "hstu_ranking.yaml", [*HSTU_OVERRIDES, *overrides])
    torch.manual_seed(3)
    items = cfg.data.synthetic.num_items
    tables = {"item_table": torch.randn(items, 16) * 0.3, "user_table": torch.randn(50, 16) * 0.3}
    settings = task_settings(cfg)
    settings.pop("max_uih_len")
    task = _with_strong_bias(build_task(cfg.model, max_uih_len=cfg.data.max_uih_len, **settings))
    trained = Trained(cfg, "(in memory)", 0, "", tables, task.state_dict())
    model = trained_model(trained)
    out = tmp_path / (name or quantize)
    write_export(trained, model.task, {"samples": 0}, str(out), quantize)
    return model, load_export(str(out))


def _jagged_batch(lengths, counts, items=300, labels=2, seed=0):
    import numpy as np

    from freescale.data.batch import Batch, Samples

    g = np.random.default_rng(seed)
    lengths, counts = np.array(lengths), np.array(counts)
    gaps = (10 ** (g.random(int(lengths.sum())) * 9)).astype(np.int64)
    uih_ts = 1_600_000_000 + np.cumsum(gaps)
    samples = Samples(sample_ids=np.arange(len(lengths)), user_ids=g.integers(0, 1000, len(lengths)),
                      uih_lengths=lengths, uih_values=g.integers(0, items, int(lengths.sum())), uih_timestamps=uih_ts,
                      cand_counts=counts, cand_values=g.integers(0, items, int(counts.sum())),
                      cand_timestamps=uih_ts.max() + g.integers(0, 10**6, int(counts.sum())),
                      labels=np.zeros((int(counts.sum()), labels), np.float32))
    return Batch.from_samples(samples, 0, 50)


def test_an_hstu_ranking_export_serves_a_request_of_mixed_lengths_as_training_does(tmp_path):
    model, served = _in_memory_export(tmp_path, [])
    assert served.manifest["labels"] == ["click", "liked"] and served.manifest["model"] == {"kind": "hstu",
                                                                                          "task": "ranking"}
    # Heavy-tailed histories in one request (the loader pads each length group apart), 1-4 candidates.
    lengths = [60, 1, 3, 5, 2, 64, 1, 7, 30, 4, 2, 45]
    batch = _jagged_batch(lengths, [1, 4, 2, 3, 1, 4, 2, 2, 3, 1, 4, 2])
    with torch.no_grad():
        _, out = model(batch)
    seq = batch.seq_features
    args = (seq[seq.keys()[0]].values(), batch.uih_lengths, seq[seq.keys()[1]].values(), batch.cand_counts,
            batch.user_features.values())
    got = served.predict(*args, uih_timestamps=batch.uih_timestamps, cand_timestamps=batch.cand_timestamps)
    assert got.shape == out.logits.shape == (int(batch.cand_counts.sum()), 2)
    assert float((got - out.logits).abs().max()) <= TOLERANCE
    with pytest.raises(ValueError, match="HSTU model: pass uih_timestamps"):
        served.predict(*args)


def _topk(queries, vectors, batch, k):
    scores = queries @ vectors.T
    owner = torch.repeat_interleave(torch.arange(len(batch.uih_lengths)), batch.uih_lengths)
    scores[owner, batch.seq_features.values()[:int(batch.uih_lengths.sum())]] = float("-inf")
    return scores.topk(k, dim=1).indices


RETRIEVAL = ["task.kind=retrieval", "task.num_negatives=8", "model.user_features=false"]


def test_a_retrieval_export_ranks_as_the_trained_model(tmp_path):
    """fp32 tables: the served queries equal the trained model's within the tolerance and the
    top-10 ids (history left out) are the trained model's, exactly."""
    import torch.nn.functional as F

    model, served = _in_memory_export(tmp_path, RETRIEVAL)
    batch = _jagged_batch([60, 1, 3, 5, 2, 64, 7, 30, 4, 45], [9] * 10, labels=1)
    with torch.no_grad():
        _, out = model(batch)
    uih = batch.seq_features.values()[:int(batch.uih_lengths.sum())]
    queries = served.queries(uih, batch.uih_lengths, batch.uih_timestamps)
    assert float((queries - out.queries).abs().max()) <= TOLERANCE
    vectors = F.normalize(model.item_ec.embeddings["item_table"].weight.detach(), dim=-1)
    assert float((served.items - vectors).abs().max()) <= TOLERANCE
    top = served.topk(uih, batch.uih_lengths, batch.uih_timestamps, k=10)
    assert torch.equal(top, _topk(out.queries, vectors, batch, 10))
    owner = torch.repeat_interleave(torch.arange(10), batch.uih_lengths)
    assert not (top[owner] == uih[:, None]).any()  # the history is left out


INT8_HR_TOLERANCE = 0.02  # held-out HR@10 of the int8 export against the trained fp32 model


def test_a_retrieval_export_keeps_the_held_out_figures(tmp_path):
    """Leave-one-out HR@10 etc. of the export (serve-bench's computation) against the trained
    model's (``freescale.train.retrieval`` without a process group), on the same users: equal
    with fp32 tables, within ``INT8_HR_TOLERANCE`` with int8."""
    from freescale.serve.bench import retrieval_accuracy
    from freescale.serve.export import evaluate_trained, held_out

    model, fp32 = _in_memory_export(tmp_path, RETRIEVAL)
    _, int8 = _in_memory_export(tmp_path, RETRIEVAL, "int8")
    cfg = fp32.manifest["config"]
    batches = held_out(_load_cfg(RETRIEVAL))
    trained = evaluate_trained(model, batches, _load_cfg(RETRIEVAL))
    assert trained["eval/users"] == 256 and trained["eval/hr@10"] > 0
    for served, tolerance in ((fp32, 1e-6), (int8, INT8_HR_TOLERANCE)):
        served.manifest["heldout"] = trained
        acc = retrieval_accuracy(served, batches, cfg["task"]["eval_ks"], cfg["task"]["exclude_history"])
        assert acc["exported"]["eval/users"] == 256
        assert abs(acc["diff"]["eval/hr@10"]) <= tolerance, acc
    assert acc["exported"] != trained  # int8 does move some ranks


def _load_cfg(overrides):
    from freescale.config import load_config
    from helpers.launch import REPO

    return load_config(REPO / "configs" / "hstu_ranking.yaml", [*HSTU_OVERRIDES, *overrides])


def _cut_by_hand(values, lengths, limit):
    """Each history's last ``limit`` entries, one sample at a time."""
    out, start = [], 0
    for n in lengths.tolist():
        out.append(values[start + max(0, n - limit):start + n])
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("task", ["ranking", "retrieval"])
def test_an_export_cuts_a_longer_history_to_its_latest_events_as_training_does(tmp_path, task):
    """Histories past the trained ``max_uih_len`` (64) are served as their last 64 events."""
    model, served = _in_memory_export(tmp_path, RETRIEVAL if task == "retrieval" else [])
    lengths = torch.tensor([70, 3, 130, 64, 65])
    batch = _jagged_batch(lengths.tolist(), [2] * 5, labels=1 if task == "retrieval" else 2)
    n = int(lengths.sum())
    uih, stamps = batch.seq_features.values()[:n], batch.uih_timestamps
    cut = lengths.clamp(max=64)
    cut_uih, cut_stamps = _cut_by_hand(uih, lengths, 64), _cut_by_hand(stamps, lengths, 64)
    assert len(cut_uih) == int(cut.sum()) and torch.equal(cut_uih[:64], uih[6:70])
    if task == "retrieval":
        got = served.queries(uih, lengths, stamps)
        assert torch.equal(got, served.queries(cut_uih, cut, cut_stamps))
        assert got.abs().sum() > 0
    else:
        cand = batch.seq_features.values()[n:]
        args = dict(cand_ids=cand, cand_counts=batch.cand_counts, user_ids=batch.user_features.values(),
                    cand_timestamps=batch.cand_timestamps)
        got = served.predict(uih, lengths, uih_timestamps=stamps, **args)
        assert torch.equal(got, served.predict(cut_uih, cut, uih_timestamps=cut_stamps, **args))
