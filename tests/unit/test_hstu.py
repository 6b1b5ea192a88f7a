"""HSTU layers over jagged batches: the formula, causality, the bias buckets, batch invariance, FLOPs."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from freescale.model.hstu import HSTUEncoder, HSTULayer, HSTULayout, bucket_ladder

DIM, HEADS, DQK, DV, MAX_LEN, BUCKETS = 16, 2, 6, 5, 64, 40


def make_encoder(num_layers=2, seed=0):
    torch.manual_seed(seed)
    enc = HSTUEncoder(num_layers, DIM, HEADS, DQK, DV, MAX_LEN, BUCKETS, dropout=0.1).eval()
    with torch.no_grad():  # learned biases of a visible size, so a dropped term shows
        for layer in enc.layers:
            layer.bias.position_weight.normal_(std=0.5)
            layer.bias.time_weight.normal_(std=0.5)
    return enc


def make_batch(lengths, targets, seed):
    g = torch.Generator().manual_seed(seed)
    lengths, targets = torch.tensor(lengths), torch.tensor(targets)
    x = torch.randn(int(lengths.sum()), DIM, generator=g)
    # Increasing times per sample, gaps from a second to days (many buckets).
    gaps = torch.exp(torch.rand(int(lengths.sum()), generator=g) * 12).long()
    ts = torch.cat([torch.cumsum(part, 0) for part in gaps.split(lengths.tolist())]) + 1_700_000_000
    return x, lengths, targets, ts


def reference_layer(layer: HSTULayer, x, lengths, targets, ts):
    """Each sample alone, padded to nothing, the bias from the formula entry by entry."""
    h, dv, dqk, n = layer.num_heads, layer.linear_dim, layer.attention_dim, layer.max_len
    pos_w, ts_w = layer.bias.position_weight, layer.bias.time_weight
    out, start = [], 0
    for length, cands in zip(lengths.tolist(), targets.tolist()):
        xs, t = x[start:start + length], ts[start:start + length].tolist()
        start += length
        hist = length - cands
        u, v, q, k = torch.split(F.silu(layer.f1(layer.norm_in(xs))), [h * dv, h * dv, h * dqk, h * dqk], dim=-1)
        pos = [min(i, hist) for i in range(length)]
        t_query = [t[i + 1] if i + 1 < hist else t[i] for i in range(length)]
        rab = torch.empty(length, length)
        mask = torch.zeros(length, length, dtype=torch.bool)
        for i in range(length):
            for j in range(length):
                bucket = min(int(math.floor(math.log(max(abs(t_query[i] - t[j]), 1)) / 0.301)), layer.bias.num_time_buckets)
                rab[i, j] = pos_w[pos[j] - pos[i] + n - 1] + ts_w[bucket]
                mask[i, j] = (j < hist and pos[j] <= pos[i]) or i == j
        heads = []
        for hd in range(h):
            qh, kh, vh = q[:, hd * dqk:(hd + 1) * dqk], k[:, hd * dqk:(hd + 1) * dqk], v[:, hd * dv:(hd + 1) * dv]
            a = F.silu(qh @ kh.T + rab) / n * mask
            heads.append(a @ vh)
        out.append(layer.f2(layer.norm_attn(torch.cat(heads, dim=1)) * u) + xs)
    return torch.cat(out)


def reference_encoder(enc, x, lengths, targets, ts):
    for layer in enc.layers:
        x = reference_layer(layer, x, lengths, targets, ts)
    return enc.norm(x)


BATCH = ([9, 30, 3, 17, 5, 12, 12, 1, 41], [2, 0, 1, 4, 0, 3, 0, 0, 5])


@pytest.mark.parametrize("max_padding", [1.25, 2.0])
def test_encoder_equals_the_per_sample_formula(max_padding):
    enc = make_encoder()
    x, lengths, targets, ts = make_batch(*BATCH, seed=1)
    layout = HSTULayout(lengths, targets, ts, MAX_LEN, max_padding)
    assert len(layout.groups) > 1
    with torch.no_grad():
        torch.testing.assert_close(enc.layers[0](x, layout), reference_layer(enc.layers[0], x, lengths, targets, ts),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(enc(x, layout), reference_encoder(enc, x, lengths, targets, ts), rtol=1e-5, atol=1e-5)


def test_gradients_reach_every_parameter():
    enc = make_encoder().train()
    x, lengths, targets, ts = make_batch(*BATCH, seed=2)
    enc(x.requires_grad_(), HSTULayout(lengths, targets, ts, MAX_LEN, 1.25)).square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in enc.parameters())


def _rows(lengths, sample):
    start = sum(lengths[:sample])
    return slice(start, start + lengths[sample])


def test_a_future_token_never_changes_an_earlier_output():
    enc = make_encoder()
    lengths, targets = [6, 20, 11], [0, 3, 2]
    x, lens, tgt, ts = make_batch(lengths, targets, seed=3)
    with torch.no_grad():
        base = enc(x, HSTULayout(lens, tgt, ts, MAX_LEN, 1.25))
        rows = _rows(lengths, 1)
        for t in (5, 10, 16):  # history tokens of sample 1 (history 0..16)
            token = rows.start + t
            x2 = x.clone()
            x2[token] += 3.0
            out = enc(x2, HSTULayout(lens, tgt, ts, MAX_LEN, 1.25))
            assert torch.equal(out[rows.start:token], base[rows.start:token])
            assert not torch.equal(out[token], base[token])
            # Its timestamp is also the query time of the token before it (the time its
            # prediction is used, as the reference does): only tokens before that one are blind to it.
            ts2 = ts.clone()
            ts2[token:rows.stop] += 10_000_000
            out = enc(x2, HSTULayout(lens, tgt, ts2, MAX_LEN, 1.25))
            assert torch.equal(out[rows.start:token - 1], base[rows.start:token - 1])
            assert not torch.equal(out[token - 1], base[token - 1])
            # Other samples never see it.
            assert torch.equal(out[:rows.start], base[:rows.start]) and torch.equal(out[rows.stop:], base[rows.stop:])


def test_a_candidate_changes_no_other_token():
    enc = make_encoder()
    lengths, targets = [6, 20, 11], [0, 3, 2]
    x, lens, tgt, ts = make_batch(lengths, targets, seed=4)
    with torch.no_grad():
        base = enc(x, HSTULayout(lens, tgt, ts, MAX_LEN, 1.25))
        for sample, cand in ((1, 0), (1, 2), (2, 1)):
            token = _rows(lengths, sample).stop - targets[sample] + cand
            x2, ts2 = x.clone(), ts.clone()
            x2[token] -= 2.0
            ts2[token] += 5_000_000
            out = enc(x2, HSTULayout(lens, tgt, ts2, MAX_LEN, 1.25))
            others = torch.ones(len(x), dtype=torch.bool)
            others[token] = False
            assert torch.equal(out[others], base[others])
            assert not torch.equal(out[token], base[token])


def test_time_buckets_and_positions_by_hand():
    # One sample, times 0, 2, 30, 100000 s; N = 4. Query times: the next token's (2, 30, 100000),
    # the last token its own (100000). bucket(x) = floor(ln(max(x, 1)) / 0.301):
    # bucket(2) = floor(2.30) = 2, bucket(28) = floor(11.07) = 11, bucket(30) = floor(11.30) = 11,
    # bucket(99970), bucket(99998), bucket(100000) = floor(38.25) = 38, bucket(0) = 0.
    layout = HSTULayout(torch.tensor([4]), torch.tensor([0]), torch.tensor([0, 2, 30, 100000]), 4, 1.25)
    (group,) = layout.groups
    assert group.time_buckets[0].tolist() == [[2, 0, 11, 38], [11, 11, 0, 38], [38, 38, 38, 0], [38, 38, 38, 0]]
    assert layout.time_buckets(20)[0][0].tolist() == [[2, 0, 11, 20], [11, 11, 0, 20], [20, 20, 20, 0],
                                                      [20, 20, 20, 0]]
    assert group.positions[0].tolist() == [[3, 4, 5, 6], [2, 3, 4, 5], [1, 2, 3, 4], [0, 1, 2, 3]]
    assert group.mask[0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    # The same tokens as a history of 2 and 2 candidates: both candidates at position 2, each with
    # its own time; the last history token uses its own time, not a candidate's.
    layout = HSTULayout(torch.tensor([4]), torch.tensor([2]), torch.tensor([0, 2, 30, 100000]), 4, 1.25)
    (group,) = layout.groups
    assert group.time_buckets[0].tolist() == [[2, 0, 11, 38], [2, 0, 11, 38], [11, 11, 0, 38], [38, 38, 38, 0]]
    assert group.positions[0].tolist() == [[3, 4, 5, 5], [2, 3, 4, 4], [1, 2, 3, 3], [1, 2, 3, 3]]
    assert group.mask[0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]]


def test_a_sample_moved_to_another_batch_gives_the_same_bits():
    enc = make_encoder()
    lengths, targets = [9, 30, 3, 17, 5, 12, 12, 41, 2], [2, 0, 1, 4, 0, 3, 0, 5, 0]
    x, lens, tgt, ts = make_batch(lengths, targets, seed=5)
    other_x, other_lens, other_tgt, other_ts = make_batch([12, 11, 40, 2, 30, 6, 16, 60, 3, 10, 12],
                                                          [1, 0, 2, 0, 3, 1, 0, 4, 0, 0, 2], seed=6)
    with torch.no_grad():
        base = enc(x, HSTULayout(lens, tgt, ts, MAX_LEN, 1.25))
        for sample in range(len(lengths)):
            rows = _rows(lengths, sample)
            for keep in (2, 5, 11):  # new batch-mates, new batch sizes, the sample in the middle
                mates = list(range(keep))
                at = keep // 2
                chunks_x = [other_x[_rows(other_lens.tolist(), i)] for i in mates]
                chunks_ts = [other_ts[_rows(other_lens.tolist(), i)] for i in mates]
                chunks_x.insert(at, x[rows])
                chunks_ts.insert(at, ts[rows])
                new_lens = other_lens[:keep].tolist()
                new_tgt = other_tgt[:keep].tolist()
                new_lens.insert(at, lengths[sample])
                new_tgt.insert(at, targets[sample])
                out = enc(torch.cat(chunks_x), HSTULayout(torch.tensor(new_lens), torch.tensor(new_tgt),
                                                          torch.cat(chunks_ts), MAX_LEN, 1.25))
                assert torch.equal(out[_rows(new_lens, at)], base[rows]), (sample, keep)


@pytest.mark.parametrize("lengths,targets", [([24], [0]), ([48], [5]), ([38, 9], [2, 0])])
def test_flops_match_the_counter(lengths, targets):
    assert all(n in bucket_ladder(MAX_LEN, 1.25) for n in lengths)  # no padding: the counter sees the formula
    enc = make_encoder()
    x, lens, tgt, ts = make_batch(lengths, targets, seed=7)
    layout = HSTULayout(lens, tgt, ts, MAX_LEN, 1.25)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        enc(x, layout)
    assert counter.get_total_flops() == enc.flops(lengths, targets) == enc.flops(lens, tgt)


@pytest.mark.parametrize("name", ["lengths", "targets", "timestamps"])
def test_device_tensors_are_refused(name):
    args = dict(lengths=torch.tensor([3, 2]), targets=torch.tensor([1, 0]), timestamps=torch.arange(5))
    args[name] = args[name].to("meta")
    with pytest.raises(ValueError, match=name):
        HSTULayout(**args, max_len=8, max_padding=1.25)


def test_out_of_range_shapes_are_refused():
    with pytest.raises(ValueError, match="max_len"):
        HSTULayout(torch.tensor([9]), torch.tensor([0]), torch.arange(9), max_len=8, max_padding=1.25)
    with pytest.raises(ValueError, match="targets"):
        HSTULayout(torch.tensor([3]), torch.tensor([3]), torch.arange(3), max_len=8, max_padding=1.25)


def test_gradients_equal_the_per_sample_formula():
    enc = make_encoder()
    x, lengths, targets, ts = make_batch(*BATCH, seed=8)
    layout = HSTULayout(lengths, targets, ts, MAX_LEN, 1.25)
    grads = []
    for run in (lambda xs: enc(xs, layout), lambda xs: reference_encoder(enc, xs, lengths, targets, ts)):
        enc.zero_grad()
        xs = x.clone().requires_grad_()
        run(xs).square().sum().backward()
        grads.append([xs.grad] + [p.grad.clone() for p in enc.parameters()])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
