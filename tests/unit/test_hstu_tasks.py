"""HSTU retrieval's L2 normalization (F.normalize's values and gradients, zero rows included) and its
sampled softmax against a per-position loop."""

import pytest
import torch
import torch.nn.functional as F

from freescale.config import ModelConfig, TaskConfig
from freescale.model.hstu_tasks import _L2Normalize


def test_l2_normalize_matches_torch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 8, dtype=torch.float64, generator=g)
    x[3], x[4] = 0.0, 1e-14  # a zero row and one below the clamp
    x.requires_grad_()
    grad = torch.randn(40, 8, dtype=torch.float64, generator=g)
    ours = _L2Normalize.apply(x)
    theirs = F.normalize(x, dim=-1)
    assert torch.equal(ours, theirs)
    torch.testing.assert_close(torch.autograd.grad(ours, x, grad)[0], torch.autograd.grad(theirs, x, grad)[0])


def _sampled_softmax_by_hand(queries, items, item_ids, uih_lengths, cand_counts, tau, in_batch, stride,
                             shared=False):
    """The retrieval loss one position at a time: its target (the next history item, the sample's
    next item for the last), against the sample's negatives and the batch's next items, a column
    whose id is the target's left out; mean over the positions kept (with overlapping windows,
    ``stride`` > 0: each sample's last ``stride``). ``shared``: a position's negatives are one of
    each item id among every sample's negatives."""
    n_uih = int(uih_lengths.sum())
    first = [n_uih + int(c) for c in torch.cumsum(cand_counts, 0) - cand_counts]
    every = {}  # item id -> its first drawn negative's row, over all samples in order
    for b in range(len(first)):
        for j in range(int(cand_counts[b]) - 1):
            every.setdefault(int(item_ids[first[b] + 1 + j]), first[b] + 1 + j)
    losses, start = [], 0
    for b, length in enumerate(uih_lengths.tolist()):
        for t in range(length):
            if stride and t < length - stride:
                continue
            q = queries[start + t] / tau
            target = start + t + 1 if t < length - 1 else first[b]
            columns = [q @ items[target]]
            others = (list(every.values()) if shared else
                      [first[b] + 1 + j for j in range(int(cand_counts[b]) - 1)])
            others += first if in_batch else []
            columns += [q @ items[o] for o in others if item_ids[o] != item_ids[target]]
            losses.append(-torch.log_softmax(torch.stack(columns), 0)[0])
        start += length
    return torch.stack(losses).mean()


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("in_batch", [True, False])
@pytest.mark.parametrize("stride", [0, 2])
def test_the_sampled_softmax_is_the_per_position_formula(in_batch, stride, shared):
    """HSTURetrievalTask's loss and its gradient against the loop above: accidental hits (ids drawn
    from 6, so negatives often equal a target) left out, samples with different negative counts,
    with ``task.window_stride`` only each window's last ``stride`` positions, and with
    ``task.shared_negatives`` the batch's distinct negatives for every position."""
    from freescale.model.hstu_tasks import HSTURetrievalTask, _owner, _within
    from freescale.model.jagged_attention import offsets_of

    cfg = ModelConfig(kind="hstu", embedding_dim=8, num_layers=1, num_heads=1, mlp_dims=[8], user_features=False)
    task = HSTURetrievalTask(cfg, TaskConfig(kind="retrieval", num_negatives=3, temperature=0.1,
                                             in_batch_negatives=in_batch, window_stride=stride,
                                             shared_negatives=shared), max_len=6)
    g = torch.Generator().manual_seed(0)
    uih_lengths, cand_counts = torch.tensor([4, 1, 6, 3]), torch.tensor([4, 4, 2, 4])
    n = int(uih_lengths.sum() + cand_counts.sum())
    queries = torch.randn(int(uih_lengths.sum()), 8, generator=g, dtype=torch.float64)
    items = torch.randn(n, 8, generator=g, dtype=torch.float64)
    item_ids = torch.randint(0, 6, (n,), generator=g)
    owner, within = _owner(uih_lengths), _within(uih_lengths)
    first = int(uih_lengths.sum()) + offsets_of(cand_counts)[:-1]
    target = torch.where(within == uih_lengths[owner] - 1, first[owner], torch.arange(len(owner)) + 1)
    got = task._loss(queries, items, item_ids, target, owner, uih_lengths, cand_counts, first)
    want = _sampled_softmax_by_hand(queries, items, item_ids, uih_lengths, cand_counts, 0.1, in_batch, stride,
                                    shared)
    torch.testing.assert_close(got, want)
    # The gradient reaches each shared negative's first draw only (a repeat's would go to the same
    # table row); against the loop's.
    grads = [torch.autograd.grad(loss, items)[0] for loss in (
        task._loss(queries, items.requires_grad_(), item_ids, target, owner, uih_lengths, cand_counts, first),
        _sampled_softmax_by_hand(queries, items, item_ids, uih_lengths, cand_counts, 0.1, in_batch, stride, shared))]
    torch.testing.assert_close(grads[0], grads[1])
