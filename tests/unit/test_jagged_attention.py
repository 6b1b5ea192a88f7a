
import pytest
import torch
import torch.nn.functional as F

from freescale.model.jagged_attention import JaggedLayout, group_by_length, offsets_of


def reference(q, k, v, q_len, kv_len, heads):
    """Per-sample attention without padding."""
    out = []
    qo, ko = offsets_of(q_len), offsets_of(kv_len)
    dim = q.shape[-1]
    for i in range(len(q_len)):
        qi = q[qo[i]:qo[i + 1]].view(-1, heads, dim // heads).transpose(0, 1)
        ki = k[ko[i]:ko[i + 1]].view(-1, heads, dim // heads).transpose(0, 1)
        vi = v[ko[i]:ko[i + 1]].view(-1, heads, dim // heads).transpose(0, 1)
        out.append(F.scaled_dot_product_attention(qi, ki, vi).transpose(0, 1).reshape(-1, dim))
    return torch.cat(out)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("max_padding", [1.0, 1.25, 4.0])
def test_grouped_attention_equals_per_sample_attention(seed, max_padding):
    g = torch.Generator().manual_seed(seed)
    kv_len = torch.randint(1, 60, (17,), generator=g)
    kv_len[3] = 300  # a long history among short ones
    q_len = torch.randint(0, 4, (17,), generator=g)
    dim, heads = 16, 4
    k, v = torch.randn(int(kv_len.sum()), dim, generator=g), torch.randn(int(kv_len.sum()), dim, generator=g)
    q_self = torch.randn(int(kv_len.sum()), dim, generator=g)
    q_cand = torch.randn(int(q_len.sum()), dim, generator=g)

    self_out = JaggedLayout(kv_len, kv_len, max_padding).attend(q_self, k, v, heads)
    torch.testing.assert_close(self_out, reference(q_self, k, v, kv_len, kv_len, heads), rtol=1e-5, atol=1e-5)
    cross_out = JaggedLayout(kv_len, q_len, max_padding).attend(q_cand, k, v, heads)
    torch.testing.assert_close(cross_out, reference(q_cand, k, v, q_len, kv_len, heads), rtol=1e-5, atol=1e-5)


def test_gradients_flow_through_the_layout():
    kv_len = torch.tensor([3, 7, 1])
    x = torch.randn(11, 8, requires_grad=True)
    out = JaggedLayout(kv_len, kv_len, 1.25).attend(x, x, x, 2)
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_groups_partition_samples_within_the_padding_bound():
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 2000, (128,), generator=g).tolist()
    for bound in (1.0, 1.25, 2.0):
        groups = group_by_length(lengths, bound)
        members = sorted(i for grp in groups for i in grp)
        assert members == list(range(128))
        for grp in groups:
            padded = len(grp) * max(lengths[i] for i in grp)
            assert len(grp) == 1 or padded <= bound * sum(lengths[i] for i in grp) + 1e-9
    # With no padding allowed, only equal lengths share a group.
    assert all(len({lengths[i] for i in grp}) == 1 for grp in group_by_length(lengths, 1.0))
