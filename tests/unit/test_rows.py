"""The collision / exclusive split on hand-built id sets."""

import torch

from freescale.embedding.rows import in_rows, split_rows


def t(*xs):
    return torch.tensor(xs, dtype=torch.int64)


def test_rows_split_by_whether_the_current_batch_writes_them():
    s = split_rows(written=t(5, 1, 9, 1, 3), read=t(3, 7, 3, 2, 9, 11))
    assert s.collision.tolist() == [3, 9]
    assert s.exclusive.tolist() == [2, 7, 11]
    assert s.deferred.tolist() == [1, 5]
    assert s.rate == 2 / 5  # unique rows, not ids: 3 is read twice but is one row


def test_no_rows_in_common_are_all_exclusive_and_all_deferred():
    s = split_rows(written=t(0, 1, 2), read=t(3, 4, 4))
    assert s.collision.tolist() == [] and s.exclusive.tolist() == [3, 4] and s.deferred.tolist() == [0, 1, 2]
    assert s.rate == 0.0


def test_the_same_rows_are_all_collisions_and_nothing_is_deferred():
    s = split_rows(written=t(4, 2, 2, 8), read=t(8, 4, 2))
    assert s.collision.tolist() == [2, 4, 8] and s.exclusive.tolist() == [] and s.deferred.tolist() == []
    assert s.rate == 1.0


def test_empty_batches():
    s = split_rows(written=t(), read=t(1, 2))
    assert s.collision.tolist() == [] and s.exclusive.tolist() == [1, 2] and s.deferred.tolist() == []
    s = split_rows(written=t(1, 2), read=t())
    assert s.collision.tolist() == [] and s.exclusive.tolist() == [] and s.deferred.tolist() == [1, 2]
    assert s.rate == 0.0


def test_the_three_sets_partition_the_rows_of_both_batches():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        written = torch.randint(0, 40, (int(torch.randint(0, 30, (1,), generator=gen)),), generator=gen)
        read = torch.randint(0, 40, (int(torch.randint(0, 30, (1,), generator=gen)),), generator=gen)
        s = split_rows(written, read)
        w, r = set(written.tolist()), set(read.tolist())
        assert set(s.collision.tolist()) == w & r
        assert set(s.exclusive.tolist()) == r - w
        assert set(s.deferred.tolist()) == w - r


def test_in_rows_marks_every_occurrence():
    assert in_rows(t(3, 1, 3, 0), t(3)).tolist() == [True, False, True, False]


def test_row_marks_give_what_sorting_gives_call_after_call():
    """RowMarks (a mark per local row, as PEC's overlap checker) against split_rows and in_rows,
    over successive steps on one buffer: a mark left set would show in a later step."""
    from freescale.embedding.rows import RowMarks

    g = torch.Generator().manual_seed(3)
    marks = RowMarks(50)
    for step in range(40):
        hi = int(torch.randint(1, 50, (1,), generator=g))
        written, read = (torch.randint(0, hi, (int(torch.randint(0, 30, (1,), generator=g)),), generator=g)
                         for _ in range(2))
        ids = torch.randint(0, 50, (25,), generator=g)
        want, got = split_rows(written, read), marks.split(written, read)
        for field in ("written", "collision", "exclusive"):
            assert torch.equal(getattr(got, field), getattr(want, field)), (step, field)
        assert [m.tolist() for m in marks.among(want.collision, ids, read)] == \
            [in_rows(ids, want.collision).tolist(), in_rows(read, want.collision).tolist()]
        assert not marks.marks.any()
