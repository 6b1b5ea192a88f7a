"""The prioritized pipeline against synchronous updates of the same tables, bit for bit, on 2
gloo ranks; its schedule (what goes early, what goes on the high lane); ``freescale verify``."""

import json
from contextlib import contextmanager

import pytest
import torch

from freescale.config import load_config
from freescale.device import Streams
from freescale.distributed import Topology
from freescale.embedding.pipeline import build_owned_model
from freescale.profile.timeline import NullTimeline
from freescale.train.verify import snapshot
from freescale.transport.base import HIGH, NORMAL
from helpers.launch import FAST, QUICKSTART, REPO, check, freescale, metrics, ranks
from helpers.owned_tables import ITEMS, SMALL, batches_of, build, train_through
from helpers.spawn import run_ranks

pytestmark = pytest.mark.slow


class RecordingStreams:
    """A device module for ``freescale.device.Streams`` whose streams (``compute``, ``side``) log
    which waits for which; the current stream is what a ``stream`` context makes it."""

    def __init__(self, log):
        self.log = log
        self.current = _Stream("compute", log)

    def Stream(self, device=None):
        return _Stream("side", self.log)

    def current_stream(self, device=None):
        return self.current

    @contextmanager
    def stream(self, stream):
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def synchronize(self, device=None):
        pass


class _Stream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(("stream_wait", self.name, other.name))


class RecordingTransport:
    """A transport that logs what is issued (lane, row width, rows sent, on which stream) and
    when it is waited for."""

    def __init__(self, inner, log, streams=None):
        self.inner, self.log, self.streams = inner, log, streams
        self.rank, self.world_size = inner.rank, inner.world_size

    def all_to_all_single(self, tensor, ins, outs, lane=NORMAL):
        stream = self.streams.current.name if self.streams is not None else None
        issued = ("a2a", lane, tuple(tensor.shape[1:]), sum(ins), len(self.log), stream)
        self.log.append(issued)
        return RecordedHandle(self.inner.all_to_all_single(tensor, ins, outs, lane=lane), issued, self.log)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class RecordedHandle:
    def __init__(self, inner, issued, log):
        self.inner, self.issued, self.log = inner, issued, log

    def wait(self):
        self.log.append(("wait", self.issued))
        return self.inner.wait()


class RecordingTimeline(NullTimeline):
    """Logs the pipeline's spans as they open and close."""

    def __init__(self, log):
        self.log = log

    @contextmanager
    def span(self, kind):
        self.log.append(("open", kind))
        try:
            yield
        finally:
            self.log.append(("close", kind))


def _train(mode, rank, world, transport_kind, log=None, steps=None, device="cpu", lanes=2):
    model, optimizer, pipeline = build(mode, rank, world, transport_kind,
                                       NullTimeline() if log is None else RecordingTimeline(log), device=device,
                                       overrides=[f"--transport.lanes={lanes}"])
    assert pipeline.transport.lanes == lanes  # (the pipeline built its transport as the config says)
    if log is not None:
        # Streams as on a GPU: the side-stream exchanges and their hand-overs are logged.
        recorder = RecordingStreams(log)
        pipeline.inner.streams = Streams("cpu", module=recorder)
        pipeline.inner.side = pipeline.inner.streams.side()
        pipeline.inner.transport = RecordingTransport(pipeline.inner.transport, log, recorder)
    losses = train_through(pipeline, iter(batches_of(rank)[:steps]))
    if log is not None:
        log.append(("drain",))
    pipeline.drain()
    state = snapshot(model, optimizer)
    rates = list(getattr(pipeline.inner, "collision_rates", []))
    pipeline.close()
    return losses, state, rates


def _bitwise(rank, world, transport_kind, lanes=2):
    ref_losses, ref, _ = _train("sync", rank, world, transport_kind)
    losses, got, rates = _train("prioritized", rank, world, transport_kind, lanes=lanes)
    assert len(losses) == len(ref_losses) == 26
    assert losses == ref_losses
    for kind in ref:
        assert ref[kind].keys() == got[kind].keys() and ref[kind], kind
        for key in ref[kind]:
            assert torch.equal(ref[kind][key], got[kind][key]), (kind, key)
    # The stream has every case: steps with no rows in common, and steps with only rows in common.
    assert 0.0 in rates and 1.0 in rates and any(0.0 < r < 1.0 for r in rates), rates
    # And it trained: the rows moved away from their initial values.
    fresh = build_owned_model(load_config(QUICKSTART, SMALL), num_items=ITEMS, max_uih_len=16,
                              topology=Topology(rank=rank, world_size=world, local_rank=rank, local_world_size=world),
                              seed=7)
    assert not torch.equal(fresh.tables.weight, got["embedding rows"]["weight"])


@pytest.mark.parametrize("transport_kind", ["torch_dist", "host_staged"])
def test_prioritized_training_is_bitwise_equal_to_synchronous_updates(transport_kind):
    run_ranks(2, _bitwise, transport_kind)


@pytest.mark.parametrize("transport_kind", ["torch_dist", "host_staged"])
def test_prioritized_training_on_one_lane_is_bitwise_equal_to_synchronous_updates(transport_kind):
    # transport.lanes 1: the collision rows' exchanges queue behind the others instead of passing them.
    run_ranks(2, _bitwise, transport_kind, 1)


CUDA_TOLERANCE = 1e-5  # losses and state, sync against prioritized on the GPU


def _on_cuda(rank, world):
    torch.cuda.set_device(0)  # both ranks share the one GPU (gloo and host_staged: NCCL refuses that)
    ref_losses, ref, _ = _train("sync", rank, world, "host_staged", device="cuda")
    losses, got, rates = _train("prioritized", rank, world, "host_staged", device="cuda")
    assert len(losses) == len(ref_losses) == 26
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= CUDA_TOLERANCE
    for kind in ref:
        for key in ref[kind]:
            assert got[kind][key].device == ref[kind][key].device
            diff = float((got[kind][key].double() - ref[kind][key].double()).abs().max()) if ref[kind][key].numel() else 0.0
            assert diff <= CUDA_TOLERANCE, (kind, key, diff)
    assert got["embedding rows"]["weight"].is_cuda
    assert 0.0 in rates and 1.0 in rates, rates


@pytest.mark.gpu
def test_prioritized_training_on_the_gpu_matches_synchronous_updates_on_two_ranks_sharing_it():
    run_ranks(2, _on_cuda)


ROWS = (8,)  # the width of the embedding rows and their gradients; ids and flags have none


def _schedule(rank, world):
    log, sync_log = [], []
    _, _, rates = _train("prioritized", rank, world, "torch_dist", log=log, steps=12)
    _train("sync", rank, world, "torch_dist", log=sync_log, steps=12)
    assert any(0.0 < r < 1.0 for r in rates[1:10]), rates  # steps with collision and exclusive rows both
    forwards = [i for i, e in enumerate(log) if e == ("open", "forward")]
    assert len(forwards) == 12
    # What this rank sends as owner of the rows each batch reads, in the synchronous reference:
    # its one row exchange, the last before the batch's forward.
    sync_forwards = [i for i, e in enumerate(sync_log) if e == ("open", "forward")]
    rows_of = [[e for e in sync_log[:f] if e[0] == "a2a" and e[2] == ROWS][-1][3] for f in sync_forwards]
    for j in range(1, 10):  # the steps with a batch after them
        window = log[forwards[j]:forwards[j + 1]]
        issued = [e for e in window if e[0] == "a2a" and e[2] == ROWS]
        # After step j's forward: batch j+1's exclusive rows (normal lane, while the backward runs);
        # after its backward (it needs the gradients): the collision gradients and then batch
        # j+1's collision rows (high lane), and the other gradients (normal, deferred).
        assert [e[1] for e in issued] == [NORMAL, HIGH, HIGH, NORMAL], (j, issued)
        exclusive, collision = issued[0], issued[2]
        # Every row batch j+1 reads is sent once: the exclusive and the collision rows make up
        # exactly what the synchronous step sends.
        assert exclusive[3] + collision[3] == rows_of[j + 1], (j, exclusive, collision, rows_of[j + 1])
        # The exclusive rows are waited for inside batch j+1's forward, not before: step j's dense
        # optimizer step, the loading of batch j+2 and the sending of its ids overlap them.
        waited = log.index(("wait", exclusive))
        forward_ends = log.index(("close", "forward"), forwards[j + 1])
        assert forwards[j + 1] < waited < forward_ends, (j, forwards[j + 1], waited, forward_ends)
        optimizer_done = max(i for i, e in enumerate(window) if e == ("close", "optimizer")) + forwards[j]
        assert optimizer_done < waited
        # The dense optimizer steps while the collision gradients cross: before they are waited for.
        assert optimizer_done < log.index(("wait", issued[1])), (j, optimizer_done, log.index(("wait", issued[1])))
        # On a GPU the exclusive rows, the collision rows and the deferred gradients go on the side
        # stream, after what the compute stream issued before (a table update, the backward), and
        # the compute stream waits for the side stream before it reads what they brought.
        assert [e[5] for e in issued] == ["side", "compute", "side", "side"], (j, issued)
        for e in (issued[0], issued[2], issued[3]):
            before = [x for x in log[:e[4]] if x[0] in ("a2a", "stream_wait")][-1]
            assert before == ("stream_wait", "side", "compute"), (j, e, before)
            at = log.index(("wait", e))
            assert log[at + 1] == ("stream_wait", "compute", "side"), (j, e, log[at + 1])


    # After a drain the compute stream waits for the side stream: the last deferred update ran
    # there (the backward of the exclusive rows' lookup), and evaluation or a checkpoint reads
    # the tables next on the compute stream.
    drained = log.index(("drain",))
    side_work = max(i for i, e in enumerate(log) if e[0] == "a2a" and e[5] == "side")
    assert side_work < drained and ("stream_wait", "compute", "side") in log[drained:], log[drained:]


def test_each_row_goes_once_and_the_exclusive_rows_are_waited_for_at_the_next_forward():
    run_ranks(2, _schedule)


class NotingTimeline(NullTimeline):
    """Keeps what the pipeline notes, per ``progress`` call (the caller opens each with ``steps.append({})``)."""

    def __init__(self):
        self.steps = []

    def note(self, key, value):
        self.steps[-1][key] = self.steps[-1].get(key, 0) + value


def _noted(mode, rank, world):
    timeline = NotingTimeline()
    model, _, pipeline = build(mode, rank, world, "torch_dist", timeline)
    batches = iter(batches_of(rank))
    try:
        while True:
            timeline.steps.append({})
            pipeline.progress(batches)
    except StopIteration:
        timeline.steps.pop()
    pipeline.close()
    return model, timeline.steps


def _exchange_bytes(rank, world):
    model, steps = _noted("prioritized", rank, world)
    _, sync_steps = _noted("sync", rank, world)
    row, id_bytes = ROWS[0] * 4, 8  # float32 rows and gradients, int64 ids
    blocks = model.tables.blocks
    # Every rank's batches, as (table, global row) pairs; which of this rank's are another rank's.
    rows = [[[(t, int(i)) for t, ids in model.segments(b) for i in ids] for b in batches_of(r)] for r in range(world)]
    remote = [[(t, i) for t, i in batch if i // blocks[t] != rank] for batch in rows[rank]]
    assert len(steps) == len(sync_steps) == len(remote) == 26
    for k, batch in enumerate(remote):
        # Each id sent to another rank, its row back and its gradient out.
        assert steps[k]["exchange_bytes"] == sync_steps[k]["exchange_bytes"] == len(batch) * (id_bytes + 2 * row), k
        assert "collision_bytes" not in sync_steps[k]
        if k + 1 == len(remote):
            assert "collision_bytes" not in steps[k]  # the last batch: no batch after it to go first for
            continue
        # Rows batch k writes (any rank's) that batch k+1 reads: this rank's gradients of them
        # and, as a reader of batch k+1, those rows.
        collide = {p for r in range(world) for p in rows[r][k]} & {p for r in range(world) for p in rows[r][k + 1]}
        expected = sum(p in collide for p in batch) + sum(p in collide for p in remote[k + 1])
        assert steps[k]["collision_bytes"] == expected * row, k
    assert any(s.get("collision_bytes") for s in steps) and not all(s.get("collision_bytes") for s in steps[:-1])


def test_both_pipelines_note_the_bytes_their_steps_exchange_with_the_other_ranks():
    run_ranks(2, _exchange_bytes)


def _without_lanes(entry):
    """A log entry with the lane of the exchange it names left out."""
    if entry[0] == "a2a":
        return ("a2a", *entry[2:])
    if entry[0] == "wait":
        return ("wait", _without_lanes(entry[1]))
    return entry


def _one_lane(rank, world):
    two, one = [], []
    _train("prioritized", rank, world, "torch_dist", log=two, steps=12)
    _train("prioritized", rank, world, "torch_dist", log=one, steps=12, lanes=1)
    assert HIGH in {e[1] for e in two if e[0] == "a2a"}
    # Nothing asks for a lane the transport does not have, and the schedule is the same: the
    # same exchanges, waits, spans and stream hand-overs in the same order.
    assert {e[1] for e in one if e[0] == "a2a"} == {NORMAL}
    assert [_without_lanes(e) for e in one] == [_without_lanes(e) for e in two]


def test_on_one_lane_the_schedule_is_the_same_with_every_exchange_on_lane_0():
    run_ranks(2, _one_lane)


def test_verify_cli_is_bitwise_with_the_balancer_on(tmp_path):
    proc = check(ranks(2, "verify", "--config", str(QUICKSTART), *FAST, "--steps=20", "--balance.enable=true",
                          "--data.synthetic.num_items=512", timeout=600))
    assert "bitwise identical" in proc.stdout and "NOT" not in proc.stdout
    table = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(table) == 20 and all(float(row[-1]) == 0.0 for row in table)


@pytest.mark.parametrize("task,extra", [("ranking", []), ("retrieval", []),
                                        ("retrieval", ["--task.shared_negatives=true"])],
                         ids=["ranking", "retrieval", "retrieval-shared-negatives"])
def test_verify_cli_is_bitwise_with_hstu(task, extra):
    # HSTU's dropout masks are keyed by the samples (freescale.model.dropout), alike in both pipelines.
    proc = check(ranks(2, "verify", "--config", str(REPO / "configs" / "hstu_ranking.yaml"), *FAST, "--steps=6",
                          "--balance.enable=true", f"--task.kind={task}", "--task.num_negatives=16",
                          "--data.synthetic.num_items=512", *extra, timeout=600))
    assert "bitwise identical" in proc.stdout and "NOT" not in proc.stdout
    table = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(table) == 6 and all(float(row[-1]) == 0.0 for row in table)


SIDE_DATA = ["--data.synthetic.user_features=true", "--data.synthetic.item_features=true"]


@pytest.mark.parametrize("extra", [
    ["--model.side_features=[{name: user:clusters, pooling: mean}, {name: item:cluster}]"],
    ["--model.kind=hstu", "--model.side_features=[{name: user:clusters}, {name: item:cluster, kind: sequence}]"],
    ["--model.kind=hstu", "--task.kind=retrieval", "--task.num_negatives=16", "--model.user_features=false",
     "--model.side_features=[{name: item:cluster, kind: sequence, pooling: mean}]"],
], ids=["transformer-pooled", "hstu-sequence", "hstu-retrieval"])
def test_verify_cli_is_bitwise_with_side_features(extra):
    # The side tables are owned tables like the others (a pooled item feature sends its candidates'
    # values only); their rows, states and the join's projections are compared too.
    proc = check(ranks(2, "verify", "--config", str(QUICKSTART), *FAST, "--steps=6", "--balance.enable=true",
                          "--data.synthetic.num_items=512", *SIDE_DATA, *extra, timeout=600))
    assert "bitwise identical" in proc.stdout and "NOT" not in proc.stdout
    table = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(table) == 6 and all(float(row[-1]) == 0.0 for row in table)


def test_verify_refuses_a_side_feature_the_source_lacks_or_own_tables_cannot_hold():
    proc = freescale("verify", "--config", str(QUICKSTART), "--model.side_features=[{name: user:clusters}]")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == ("freescale: error: model.side_features[0].name: the source has no "
                                                    "side feature user:clusters (it has: none)")
    proc = freescale("verify", "--config", str(QUICKSTART), *SIDE_DATA, "--model.side_features=[{name: user:clusters, "
                     "dim: 8}]")
    assert proc.returncode == 2 and "model.side_features[0].dim: FreeScale's own tables" in proc.stderr


def test_verify_cli_refuses_a_single_step():
    proc = freescale("verify", "--config", str(QUICKSTART), "--steps=1")
    assert proc.returncode == 2 and "--steps: expected at least 2" in proc.stderr


def test_training_runs_of_both_pipelines_log_the_same_losses_and_evaluations(tmp_path):
    # Evaluation in mid-run reads the tables: the pipeline drains its deferred updates first.
    runs = {}
    for pipeline in ("sync", "prioritized"):
        run_dir = tmp_path / pipeline
        check(ranks(2, "train", "--config", str(QUICKSTART), *FAST, "--train.steps=7", "--train.eval_every=3",
                       f"--train.pipeline={pipeline}", f"--run.dir={run_dir}"))
        runs[pipeline] = [{k: v for k, v in r.items()
                           if not k.startswith(("throughput", "time", "train/tflops", "train/mfu"))}  # (timings)
                          for r in metrics(run_dir)]
    evals = [r for r in runs["sync"] if "eval/auc" in r]
    assert [r["step"] for r in evals] == [3, 6, 7]
    assert runs["prioritized"] == runs["sync"]


def test_the_report_shows_the_collision_rate_the_hot_items_set(tmp_path):
    big = ["--data.synthetic.num_items=2000000", "--data.synthetic.hot_items=64", "--train.pipeline=prioritized",
           "--train.steps=8", "--profile.enable=true", "--profile.warmup_steps=2",
           "--model.user_features=false"]  # (user rows, hashed from a million users, hardly ever collide)
    rates = {}
    for p in (0.0, 1.0):
        run_dir = tmp_path / f"hot{p}"
        check(ranks(2, "train", "--config", str(QUICKSTART), *FAST, *big, f"--data.synthetic.hot_prob={p}",
                       f"--run.dir={run_dir}", "--profile.trace_steps=[4,5]"))
        report = json.loads((run_dir / "report" / "report.json").read_text())
        rates[p] = report["summary"]["collision_rate"]
        # The rate is the profile's counts: collision rows over rows read, every rank, steps after warm-up.
        records = [json.loads(line) for r in (0, 1) for line in (run_dir / "profile" / f"rank{r}.jsonl").open()]
        counted = [rec for rec in records if rec.get("step", 0) > 2]
        expected = sum(r["collision_rows"] for r in counted) / sum(r["read_rows"] for r in counted)
        assert rates[p] == pytest.approx(expected, abs=1e-6)
        # And the bytes a rank's step exchanges with the others, mean over the ranks' steps.
        for key in ("exchange_bytes", "collision_bytes"):
            mean = sum(r.get(key, 0) for r in counted) / len(counted)
            assert report["summary"][f"{key}_per_step"] == pytest.approx(mean, abs=0.1) and mean > 0, key
        assert "collision rate" in (run_dir / "report" / "report.html").read_text()
        # The pipeline's waits and exchanges are profiler ranges in each rank's trace.
        for r in (0, 1):
            trace = json.loads((run_dir / "profile" / f"trace_rank{r}.json").read_text())
            names = {e.get("name") for e in trace["traceEvents"]}
            assert {"freescale.id_wait", "freescale.flags_wait", "freescale.exclusive_wait", "freescale.collision_wait",
                    "freescale.exclusive_send", "freescale.collision_send", "freescale.deferred_send"} <= names, \
                sorted(n for n in names if str(n).startswith("freescale"))
    assert rates[0.0] < 0.02 and rates[1.0] > 0.9
