"""The ledger's audit on hand-built ledgers, the ledger cut back by batch, and the data cursor
that carries every replica group's position."""

import json

import pytest
import torch

from freescale.train.ledger import Ledger, audit, exactly_once, ledger_path, read_ledger
from freescale.train.state import DataCursor

# Two global batches of four samples; two ranks train two samples each.
EXPECTED = {0: [10, 11, 12, 13], 1: [14, 15, 16, 17]}


def records(*rows):
    return [{"step": s, "replica": 0, "rank": r, "batch": b, "sample_ids": ids} for s, r, b, ids in rows]


CLEAN = records((1, 0, 0, [10, 11]), (1, 1, 0, [12, 13]), (2, 0, 1, [14, 15]), (2, 1, 1, [16, 17]))


def test_a_clean_ledger_is_exactly_once():
    result = audit(CLEAN, EXPECTED, reached={0: 2}, last_step=2)
    assert result == {"samples_lost": 0, "samples_repeated": 0, "unexpected": 0, "unfinished": [], "complete": True}
    assert exactly_once(result)


def test_a_dropped_record_loses_its_samples():
    result = audit(CLEAN[:3], EXPECTED)
    assert result == {"samples_lost": 2, "samples_repeated": 0, "unexpected": 0} and not exactly_once(result)


def test_a_duplicated_record_repeats_its_samples():
    result = audit(CLEAN + CLEAN[1:2], EXPECTED)
    assert result == {"samples_lost": 0, "samples_repeated": 2, "unexpected": 0} and not exactly_once(result)
    # Trained again by another rank at another step counts the same.
    result = audit(CLEAN + records((5, 0, 1, [17])), EXPECTED)
    assert result["samples_repeated"] == 1


def test_a_foreign_record_is_unexpected():
    result = audit(CLEAN + records((3, 0, 2, [18, 19])), EXPECTED)  # a batch no group should have reached
    assert result == {"samples_lost": 0, "samples_repeated": 0, "unexpected": 2} and not exactly_once(result)
    result = audit(CLEAN[:3] + records((2, 1, 1, [16, 99])), EXPECTED)  # a sample the batch does not hold
    assert result == {"samples_lost": 1, "samples_repeated": 0, "unexpected": 1}


def test_a_run_that_stopped_short_is_incomplete_however_clean_its_ledger():
    result = audit(CLEAN, EXPECTED, reached={0: 1000, 1: 12}, last_step=1000)
    assert result["samples_lost"] == 0 and result["samples_repeated"] == 0
    assert result["complete"] is False and result["unfinished"] == [1]
    assert not exactly_once(result)


def test_the_ledger_is_cut_back_by_batch_not_by_step(tmp_path):
    path = ledger_path(str(tmp_path), 1, 0)
    first = Ledger(str(tmp_path), replica=1, rank=0, keep_before=0, position_after=lambda b: (b - 1) // 2 + 1)
    for step, batch in [(14, 1), (15, 3), (16, 5), (300, 7), (301, 9)]:  # steps as a group that caught up counts them
        first.record(step, batch, torch.tensor([batch]))
    first.close()
    # The state this launch starts from has trained the group's first three batches (1, 3, 5).
    Ledger(str(tmp_path), replica=1, rank=0, keep_before=3, position_after=lambda b: (b - 1) // 2 + 1).close()
    with open(path) as f:
        assert [json.loads(line)["batch"] for line in f] == [1, 3, 5]


def test_a_batch_is_written_as_it_enters_a_step_and_once_however_often_the_step_is_tried(tmp_path):
    ledger = Ledger(str(tmp_path), replica=0, rank=0, keep_before=0, position_after=lambda b: b + 1)
    ledger.entering(1, 0, torch.tensor([10]))  # written before the vote: this rank may die before it
    assert [r["batch"] for r in read_ledger(str(tmp_path))] == [0]
    ledger.entering(1, 0, torch.tensor([10]))  # the vote failed, the same batch tried again
    ledger.record(1, 0, torch.tensor([10]))  # committed
    ledger.record(2, 1, torch.tensor([11]))  # a step without the layer: written at the commit
    ledger.record(3, 1, torch.tensor([11]))  # the same batch committed twice is seen twice
    ledger.entering(4, 2, torch.tensor([12]))
    ledger.close()  # ... and the process died before the step's outcome
    assert [r["batch"] for r in read_ledger(str(tmp_path))] == [0, 1, 1, 2]
    # Restarted where the committed steps left the cursor (batch 2 not trained): its record goes.
    Ledger(str(tmp_path), replica=0, rank=0, keep_before=2, position_after=lambda b: b + 1).close()
    assert [r["batch"] for r in read_ledger(str(tmp_path))] == [0, 1, 1]


def test_the_cursor_holds_every_groups_position_and_takes_its_own_from_a_state():
    class Loader:
        shard, next_batch = 1, 4

        def load_state_dict(self, state):
            self.next_batch = state["next_batch"]

        def iter_samples(self):
            yield self.next_batch

        def position_after(self, batch):
            return (batch - 1) // 3 + 1

    cursor = DataCursor(Loader(), groups=3)
    assert cursor.positions == [0, 4, 0]
    cursor.advance_past(13)  # global batch 13 is group 1's position 4
    assert cursor.next_batch == 5 and cursor.state_dict()["groups"].tolist() == [0, 5, 0]
    other = DataCursor(Loader(), groups=3)
    other.load_state_dict({"next_batch": torch.tensor(9), "groups": torch.tensor([7, 2, 9])})  # a peer's: its own is 9
    assert other.next_batch == 2 and other.positions == [7, 2, 9]
    assert other.loader.next_batch == 4  # a load leaves the stream where it is
    assert next(other.stream()) == 2  # the stream starts from the cursor
    with pytest.raises(ValueError, match="data cursors of 2 replica group"):
        other.load_state_dict({"next_batch": torch.tensor(1), "groups": torch.tensor([1, 1])})
    alone = DataCursor(Loader(), groups=1)
    assert "groups" not in alone.state_dict() and alone.next_batch == 4


# `freescale local`'s check over hand-written run folders: two groups of two ranks, global batches
# of 2 x 16 synthetic samples (whose ids are their stream positions); group 0 trained its
# shard's batches 0, 2, 4, group 1 its 1, 3, and both are at the last step, 4.
GROUP_BATCH = 32
CURSORS = {0: 3, 1: 2}


def _records() -> list[dict]:
    return [{"step": p + 1, "replica": g, "rank": r, "batch": p * 2 + g,
             "sample_ids": list(range((p * 2 + g) * GROUP_BATCH + 16 * r, (p * 2 + g) * GROUP_BATCH + 16 * (r + 1)))}
            for g, n in CURSORS.items() for p in range(n) for r in range(2)]


def _drop_last_sample(records):
    records[0]["sample_ids"].pop()


def _train_a_record_again_on_the_other_rank(records):
    records.append({**records[0], "rank": 1, "step": 9})


def _lose_a_batch(records):
    records[:] = [r for r in records if r["batch"] != 4]


def _record_a_batch_past_the_cursor(records):
    records.append({**records[0], "batch": 6, "sample_ids": list(range(6 * GROUP_BATCH, 6 * GROUP_BATCH + 16))})


def _write_run(root, records: list[dict], steps: dict) -> list:
    from freescale.local import Group

    groups = []
    for g in CURSORS:
        folder = root / f"replica{g}"
        (folder / "ledger").mkdir(parents=True)
        (folder / "ft_cursor.json").write_text(json.dumps({"step": steps[g], "next_batch": CURSORS[g], "time": 0}))
        for r in range(2):
            with open(folder / "ledger" / f"replica{g}-rank{r}.jsonl", "w") as f:
                f.writelines(json.dumps(x) + "\n" for x in records if x["replica"] == g and x["rank"] == r)
        groups.append(Group(replica=g, cmd=[], run_dir=str(folder), console="", env={}))
    return groups


@pytest.mark.parametrize("fault, steps, verdict", [
    (None, {0: 4, 1: 4}, {}),
    (_drop_last_sample, {0: 4, 1: 4}, {"samples_lost": 1}),
    (_train_a_record_again_on_the_other_rank, {0: 4, 1: 4}, {"samples_repeated": 16}),
    (_lose_a_batch, {0: 4, 1: 4}, {"samples_lost": 32}),
    (_record_a_batch_past_the_cursor, {0: 4, 1: 4}, {"unexpected": 16}),
    (None, {0: 4, 1: 3}, {"unfinished": [1], "complete": False}),
], ids=["clean", "lost_sample", "repeated_sample", "missing_batch", "batch_past_cursor", "unfinished"])
def test_the_launchers_ledger_check_says_no_to_every_fault_of_the_files(tmp_path, fault, steps, verdict):
    from freescale.config import load_config
    from freescale.local import ledger_check
    from helpers.launch import REPO

    records = _records()
    if fault is not None:
        fault(records)
    groups = _write_run(tmp_path, records, steps)
    cfg = load_config(str(REPO / "configs" / "ft_local.yaml"), ["--train.steps=4"])
    assert cfg.data.batch_size * 2 == GROUP_BATCH
    result = ledger_check(cfg, groups, nproc=2)
    clean = {"samples_lost": 0, "samples_repeated": 0, "unexpected": 0, "unfinished": [], "complete": True,
             "batches": 5}
    assert result == clean | verdict
    assert exactly_once(result) == (not verdict)
