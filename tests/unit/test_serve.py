"""The served dense part against the training forward, and its ``torch.export`` program."""

import os

import numpy as np
import pytest
import torch

from freescale.config import ModelConfig
from freescale.serve.dense import ServingDense
from freescale.serve.export import export_dense
from freescale.serve.standalone import _padded, length_groups
from freescale.model.seqrec import SeqRecTask

TOLERANCE = 1e-5  # logits, padded (serving) against jagged (training)


def _task(user_features=True, d_model=0):
    torch.manual_seed(0)
    cfg = ModelConfig(embedding_dim=16, d_model=d_model, num_layers=2, num_heads=2, mlp_dims=[8],
                      user_features=user_features, attention_padding=1.25)
    return SeqRecTask(cfg, max_uih_len=6).eval()


def _batch(uih_lengths, cand_counts, dim=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    uih_lengths, cand_counts = torch.tensor(uih_lengths), torch.tensor(cand_counts)
    uih = torch.randn(int(uih_lengths.sum()), dim, generator=g)
    cand = torch.randn(int(cand_counts.sum()), dim, generator=g)
    user = torch.randn(len(uih_lengths), dim, generator=g)
    return uih, uih_lengths, cand, cand_counts, user


def _training_logits(task, uih, uih_lengths, cand, cand_counts, user):
    n = int(cand_counts.sum())
    nu = int(uih_lengths.sum())
    _, out = task(uih, cand, user if task.cfg.user_features else None, torch.zeros(nu + n, dtype=torch.long),
                  uih_lengths, cand_counts, torch.zeros(nu, dtype=torch.long), torch.zeros(n, dtype=torch.long),
                  torch.zeros(n, 1), torch.arange(len(uih_lengths)), torch.tensor(0), torch.tensor(1.0))
    return out.logits


def _serving_logits(dense, uih, uih_lengths, cand, cand_counts, user):
    L, C = max(2, int(uih_lengths.max())), max(2, int(cand_counts.max()))
    logits = dense(_padded(uih, uih_lengths, L), uih_lengths, _padded(cand, cand_counts, C), cand_counts, user)
    return logits[torch.arange(C)[None, :] < cand_counts[:, None]]


@pytest.mark.parametrize("user_features, d_model", [(True, 0), (False, 0), (True, 24)])
def test_the_padded_dense_part_computes_what_training_does(user_features, d_model):
    task = _task(user_features, d_model)
    # Histories longer than the position table (clamped), empty ones, one candidate and several.
    inputs = _batch([3, 0, 6, 9, 1, 0], [2, 1, 3, 1, 2, 2])
    with torch.no_grad():
        want = _training_logits(task, *inputs)
        got = _serving_logits(ServingDense(task).eval(), *inputs)
    assert got.shape == want.shape
    assert float((got - want).abs().max()) <= TOLERANCE
    assert torch.isfinite(got).all()


def test_the_exported_program_takes_other_sizes_than_its_example(tmp_path):
    task = _task()
    export_dense(task, str(tmp_path / "dense.pt2"))
    program = torch.export.load(str(tmp_path / "dense.pt2")).module()
    for lengths, counts in (([7, 0, 2, 4, 4, 1, 3], [1, 3, 2, 2, 1, 1, 4]), ([2], [1]), ([0, 0], [2, 2])):
        inputs = _batch(lengths, counts, seed=len(lengths))
        with torch.no_grad():
            want = _training_logits(task, *inputs)
            got = _serving_logits(program, *inputs)
        assert float((got - want).abs().max()) <= TOLERANCE, (lengths, counts)


def _in_memory_export(tmp_path, quantize="fp32"):
    """An export of a freshly initialized model (no checkpoint), and the model it came from."""
    from freescale.config import load_config
    from freescale.serve.bench import load_export
    from freescale.serve.export import Trained, trained_model, write_export
    from helpers.launch import QUICKSTART

    cfg = load_config(QUICKSTART, ["model.embedding_dim=16", "model.num_layers=1", "model.user_hash_size=50",
                                   "data.max_uih_len=64", "model.mlp_dims=[8]"])
    torch.manual_seed(3)
    tables = {"item_table": torch.randn(40, 16) * 0.3, "user_table": torch.randn(50, 16) * 0.3}
    task = SeqRecTask(cfg.model, cfg.data.max_uih_len)
    trained = Trained(cfg, "(in memory)", 0, "", tables, task.state_dict())
    model = trained_model(trained)
    write_export(trained, model.task, {"samples": 0, "candidates": 0, "auc": 0.5, "ne": 1.0}, str(tmp_path / quantize),
                 quantize)
    return model, load_export(str(tmp_path / quantize))


def test_an_export_serves_a_request_of_mixed_lengths_as_the_training_forward_does(tmp_path):
    from freescale.data.batch import Batch, Samples

    model, served = _in_memory_export(tmp_path)
    g = np.random.default_rng(0)
    # Heavy-tailed histories (and empty ones) in one request: the loader pads each length group apart.
    lengths = np.array([60, 0, 3, 5, 2, 64, 1, 0, 7, 30, 4, 2])
    counts = g.integers(1, 5, len(lengths))
    samples = Samples(sample_ids=np.arange(len(lengths)), user_ids=g.integers(0, 1000, len(lengths)),
                      uih_lengths=lengths, uih_values=g.integers(0, 40, int(lengths.sum())),
                      uih_timestamps=np.zeros(int(lengths.sum()), np.int64), cand_counts=counts,
                      cand_values=g.integers(0, 40, int(counts.sum())), cand_timestamps=np.zeros(int(counts.sum()), np.int64),
                      labels=np.zeros((int(counts.sum()), 1), np.float32))
    batch = Batch.from_samples(samples, 0, 50)
    with torch.no_grad():
        _, out = model(batch)
    seq = batch.seq_features
    got = served.predict(seq[seq.keys()[0]].values(), batch.uih_lengths, seq[seq.keys()[1]].values(),
                         batch.cand_counts, batch.user_features.values())
    assert got.shape == out.logits.shape
    assert float((got - out.logits).abs().max()) <= TOLERANCE
    assert len(length_groups(lengths.tolist(), served.max_padding)) > 1  # the request went through in several groups


def test_an_export_folder_gets_the_mode_a_plain_folder_would(tmp_path):
    import stat

    mask = os.umask(0o022)
    try:
        _in_memory_export(tmp_path)
    finally:
        os.umask(mask)
    assert stat.S_IMODE(os.stat(tmp_path / "fp32").st_mode) == 0o755  # (others read it: a server's user)


def test_the_loader_groups_a_request_as_training_groups_a_batch():
    from freescale.model.jagged_attention import group_by_length

    g = np.random.default_rng(1)
    for _ in range(200):
        lengths = [int(x) for x in g.lognormal(3, 1.2, int(g.integers(1, 40)))]
        padding = float(g.choice([1.0, 1.25, 2.0, 8.0]))
        assert length_groups(lengths, padding) == group_by_length(lengths, padding), (lengths, padding)


class DenseExportFails(RuntimeError):
    """The fault injected into an export after it has written files."""


@pytest.mark.parametrize("out_exists", [False, True])
def test_an_export_that_fails_midway_leaves_nothing_behind(tmp_path, monkeypatch, out_exists):
    """The dense export runs for real (``tables.pt`` and ``dense.pt2`` are written), then fails:
    neither ``--out`` nor a temporary sibling remains, and an empty ``--out`` that was there
    before is left as it was."""
    import os

    from freescale.serve import export as export_module

    real = export_module.export_dense
    written = []

    def fails_after_writing(task, path):
        real(task, path)
        written.extend(sorted(os.listdir(os.path.dirname(path))))
        raise DenseExportFails("injected after the tables and the program were written")

    monkeypatch.setattr(export_module, "export_dense", fails_after_writing)
    root = tmp_path / "exports"
    root.mkdir()
    if out_exists:
        (root / "fp32").mkdir()
    with pytest.raises(DenseExportFails):
        _in_memory_export(root)
    assert written == ["dense.pt2", "tables.pt"]  # the export had started writing
    assert sorted(os.listdir(root)) == (["fp32"] if out_exists else [])
    if out_exists:
        assert os.listdir(root / "fp32") == []


def test_export_and_serve_bench_refuse_bad_input_before_they_import_torch(tmp_path):
    # torch made unimportable: each mistake below is one line and exit 2 all the same. The run
    # folder is files only: its config and a checkpoint folder of step 3 (its .metadata).
    from freescale.config import dump_yaml, load_config
    from helpers.launch import QUICKSTART, freescale_without_torch

    run, sided, taken, empty = (tmp_path / name for name in ("run", "sided", "taken", "empty"))
    for folder, overrides in ((run, []), (sided, ["--data.synthetic.item_features=true",
                                                  "--model.side_features=[{name: item:cluster}]"])):
        (folder / "checkpoints" / "step_00000003").mkdir(parents=True)
        (folder / "checkpoints" / "step_00000003" / ".metadata").write_bytes(b"")
        (folder / "config.yaml").write_text(dump_yaml(load_config(QUICKSTART, overrides)))
    taken.mkdir()
    (taken / "a").write_text("")
    empty.mkdir()
    out = str(tmp_path / "out")
    for args, fragment in [
        (["export", str(tmp_path / "missing"), "--out", out], "run folder not found"),
        (["export", str(empty), "--out", out], "not a run folder (no config.yaml)"),
        (["export", str(run), "--out", out, "--step", "7"], "--step 7: no checkpoint of that step"),
        (["export", str(run), "--out", out, "--quantize", "int3"], "--quantize: expected one of fp32"),
        (["export", str(run), "--out", str(taken)], "exists and is not an empty folder"),
        (["export", str(sided), "--out", out], "the model reads side features (item:cluster)"),
        (["serve-bench", str(empty)], "not an export folder"),
        (["serve-bench", str(empty), "--batch-sizes", "0"], "--batch-sizes: expected sizes >= 1"),
    ]:
        proc = freescale_without_torch(*args)
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith("freescale: error: ") and fragment in line, (args, line)
    assert not os.path.exists(out)
