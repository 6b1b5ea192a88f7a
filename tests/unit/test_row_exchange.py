"""The layout of what replica groups exchange about rows: headers, the gathered keys, the union's
values; three groups simulated in one process (the all-reduce is a sum of their buffers)."""

import pytest
import torch

from freescale.ft.row_exchange import (RowSpace, empty_plan, local_sums, pack_header, pack_keys, plan_rows,
                                       read_header)

SPACE = RowSpace(rows=(10, 6), widths=(3, 2))  # two blocks: 10 rows of 3 values, 6 rows of 2


def summed(buffers):
    return torch.stack(buffers).sum(0)


def test_headers_say_who_takes_part_with_which_cursor_and_how_many_keys():
    # Group 1 catches up: in the quorum, no batch, and it vetoes the step; group 3 is not in the
    # quorum at all.
    headers = [pack_header(4, 0, cursor_after=8, count=4), pack_header(4, 1, cursor_after=None, count=7, veto=True),
               pack_header(4, 2, cursor_after=5, count=0)]
    header = read_header(summed(headers), 4)
    assert header.members.tolist() == [True, True, True, False]
    assert header.present.tolist() == [True, False, True, False]
    assert header.cursors.tolist() == [8, 0, 5, 0]
    assert header.counts.tolist() == [4, 0, 0, 0]
    assert header.vetoes.tolist() == [False, True, False, False]


def test_keys_gather_into_each_groups_segment():
    keys = [torch.tensor([1, 4, 12]), torch.tensor([], dtype=torch.int64), torch.tensor([4, 15])]
    counts = torch.tensor([3, 0, 2])
    gathered = summed([pack_keys(k, counts, g) for g, k in enumerate(keys)])
    assert gathered.tolist() == [1, 4, 12, 4, 15]
    plan = plan_rows(SPACE, gathered)
    assert plan.keys.tolist() == [1, 4, 12, 15]
    assert plan.rows(0).tolist() == [1, 4] and plan.rows(1).tolist() == [2, 5]  # block 1 starts at key 10
    assert plan.size == 2 * 3 + 2 * 2


def test_values_land_at_their_rows_and_sum_over_the_groups():
    plan = plan_rows(SPACE, torch.tensor([1, 4, 12, 15]))
    mine, theirs = torch.zeros(plan.size), torch.zeros(plan.size)
    plan.scatter(0, torch.tensor([4]), torch.tensor([[1.0, 2.0, 3.0]]), mine)
    plan.scatter(1, torch.tensor([2, 5]), torch.tensor([[5.0, 6.0], [7.0, 8.0]]), mine)
    plan.scatter(0, torch.tensor([1, 4]), torch.tensor([[9.0, 9.0, 9.0], [10.0, 10.0, 10.0]]), theirs)
    total = summed([mine, theirs])
    assert plan.values(total, 0).tolist() == [[9.0, 9.0, 9.0], [11.0, 12.0, 13.0]]
    assert plan.values(total, 1).tolist() == [[5.0, 6.0], [7.0, 8.0]]
    assert plan.values(total, 1).data_ptr() == total[6:].data_ptr()  # a view of the flat buffer


def test_an_empty_plan_has_no_values():
    plan = empty_plan(SPACE)
    assert plan.size == 0 and plan.rows(0).numel() == 0 and plan.rows(1).numel() == 0


def test_local_sums_add_each_rows_repeats_in_order():
    rows = torch.tensor([5, 2, 5, 5, 2])
    values = torch.tensor([[1e8], [1.0], [1.0], [-1e8], [2.0]], dtype=torch.float32)
    unique, sums = local_sums(rows, values)
    assert unique.tolist() == [2, 5]
    # In order of appearance: (1e8 + 1) - 1e8 = 0 in float32, not 1.
    assert sums.tolist() == [[3.0], [0.0]]
    with pytest.raises(RuntimeError):
        local_sums(rows, values[:2])


def test_three_groups_reduce_to_the_sum_of_what_each_touched():
    torch.manual_seed(0)
    space = RowSpace(rows=(50,), widths=(4,))
    touched = [torch.randint(0, 50, (30,)) for _ in range(3)]
    grads = [torch.randn(30, 4) for _ in range(3)]
    sums = [local_sums(t, g) for t, g in zip(touched, grads)]
    counts = torch.tensor([len(u) for u, _ in sums])
    plan = plan_rows(space, summed([pack_keys(u, counts, g) for g, (u, _) in enumerate(sums)]))
    buffers = []
    for u, s in sums:
        out = torch.zeros(plan.size)
        plan.scatter(0, u, s, out)
        buffers.append(out)
    reference = torch.zeros(50, 4)
    for t, g in zip(touched, grads):
        reference.index_add_(0, t, g)
    assert plan.rows(0).tolist() == torch.unique(torch.cat(touched)).tolist()
    torch.testing.assert_close(plan.values(summed(buffers), 0), reference[plan.rows(0)])
