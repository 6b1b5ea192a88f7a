"""Forward+backward time of the ways to run HSTU attention over a heavy-tailed jagged batch.

Variants, all on the same encoder weights and batch:
  grouped      per-own-length padded groups (freescale.model.hstu, what the model uses)
  dense        the whole batch padded to its longest sample, one masked matmul pair
  fbgemm       as dense, padding with fbgemm's jagged_to_padded_dense / dense_to_jagged (the reference's ops)
  nested       torch.nested (strided) tensors, one sample per component, no padding
  per_sample   one group per sample (no padding): the exact reference the others are checked against
fbgemm_gpu_cpu (1.8.0 here) ships no HSTU attention op: fbgemm's HSTU kernels are a separate
build target (``hstu`` in ``fbgemm_gpu.__targets_infos__``), CUDA only, not installed with the CPU
package; generative-recommenders' own kernels are Triton/CUDA;
its jagged_dense_bmm / jagged_jagged_bmm contract over the jagged dimension and cannot form the
per-sample L x L scores, so what it offers on CPU is the reference's padding ops, used above.
torch.nested's jagged layout refuses ragged x ragged matmul on CPU; the strided layout runs.

Rounds alternate the variants; each round records a variant's median step; the table gives the
range of the medians over rounds and the ratio to grouped in the same round.

    .venv/bin/python scripts/bench_hstu_layouts.py --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from freescale.io import write_json_atomic
from freescale.model.hstu import HSTUEncoder, HSTULayout


class DenseLayout(HSTULayout):
    @staticmethod
    def grouping(lengths, max_len, max_padding):
        return [(max(lengths), list(range(len(lengths))))]


class PerSampleLayout(HSTULayout):
    @staticmethod
    def grouping(lengths, max_len, max_padding):
        return [(n, [i]) for i, n in enumerate(lengths)]


def fbgemm_attend(self, q, k, v, layout):
    """The dense path with the reference's fbgemm padding ops instead of index gathers."""
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

    h, dv, dqk = self.num_heads, self.linear_dim, self.attention_dim
    (group,), (rab,) = layout.groups, self.bias(layout)
    b, padded = group.index.shape
    offsets = layout.offsets

    def pad(t):
        return torch.ops.fbgemm.jagged_to_padded_dense(t, [offsets], [padded], 0.0)
    qh = pad(q).view(b, padded, h, dqk).transpose(1, 2)
    kh = pad(k).view(b, padded, h, dqk).transpose(1, 2)
    vh = pad(v).view(b, padded, h, dv).transpose(1, 2)
    scores = F.silu(qh @ kh.transpose(-1, -2) + rab[:, None]) / self.max_len
    out = (torch.where(group.mask[:, None], scores, 0.0) @ vh).transpose(1, 2).reshape(b, padded, h * dv)
    return torch.ops.fbgemm.dense_to_jagged(out, [offsets])[0]


def nested_attend(self, q, k, v, layout):
    """One nested-tensor matmul pair over the per-sample groups (no padding)."""
    h, dv, dqk = self.num_heads, self.linear_dim, self.attention_dim

    def nest(t, width):
        return torch.nested.as_nested_tensor([t[g.index[0]].view(-1, h, width).transpose(0, 1) for g in layout.groups])
    rabs = self.bias(layout)
    nq, nk, nv = nest(q, dqk), nest(k, dqk), nest(v, dv)
    scores = nq @ nk.transpose(-1, -2)
    bias = torch.nested.as_nested_tensor([r[0].expand(h, -1, -1) for r in rabs])
    mask = torch.nested.as_nested_tensor([g.mask[0].expand(h, -1, -1).float() for g in layout.groups])
    weights = F.silu(scores + bias) / self.max_len * mask
    out = [o.transpose(0, 1).reshape(-1, h * dv) for o in (weights @ nv).unbind()]
    return torch.cat(out)


VARIANTS = {"grouped": HSTULayout, "dense": DenseLayout, "fbgemm": DenseLayout, "nested": PerSampleLayout,
            "per_sample": PerSampleLayout}


def make_batch(batch: int, max_len: int, dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(batch, generator=g) + torch.log(torch.tensor(48.0))).long().clamp(2, 400)
    lengths[[1, batch // 2 + 3]] = torch.tensor([530, 900]).clamp(max=max_len)  # the long tails
    targets = torch.randint(1, 9, (batch,), generator=g).minimum(lengths - 1)
    x = torch.randn(int(lengths.sum()), dim, generator=g)
    gaps = torch.exp(torch.rand(int(lengths.sum()), generator=g) * 12).long()
    ts = torch.cat([torch.cumsum(p, 0) for p in gaps.split(lengths.tolist())]) + 1_700_000_000
    return x, lengths, targets, ts


def step(enc, variant, x, lengths, targets, ts, max_len, max_padding):
    layout = VARIANTS[variant](lengths, targets, ts, max_len, max_padding)
    if variant == "fbgemm":
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.long)
        torch.cumsum(lengths, 0, out=offsets[1:])
        layout.offsets = offsets
    xg = x.detach().requires_grad_()
    out = enc(xg, layout)
    out.square().sum().backward()
    return out.detach(), xg.grad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iters", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--max-padding", type=float, default=1.25)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", default="docs/results/bench_hstu_layouts.json")
    args = parser.parse_args()
    variants = args.variants.split(",")

    torch.manual_seed(0)
    head_dim = args.dim // args.heads
    enc = HSTUEncoder(args.layers, args.dim, args.heads, head_dim, head_dim, args.max_len, 128, dropout=0.0).eval()
    x, lengths, targets, ts = make_batch(args.batch, args.max_len, args.dim, seed=0)
    encoders = {}
    for name in variants:  # same weights; the nested and fbgemm variants swap the attention
        e = HSTUEncoder(args.layers, args.dim, args.heads, head_dim, head_dim, args.max_len, 128, 0.0).eval()
        e.load_state_dict(enc.state_dict())
        for layer in e.layers:
            if name == "nested":
                layer.attend = types.MethodType(nested_attend, layer)
            elif name == "fbgemm":
                layer.attend = types.MethodType(fbgemm_attend, layer)
        encoders[name] = e

    ref_out, ref_grad = step(encoders.get("per_sample", enc), "per_sample", x, lengths, targets, ts, args.max_len,
                             args.max_padding)
    errors = {}
    for name in variants:
        out, grad = step(encoders[name], name, x, lengths, targets, ts, args.max_len, args.max_padding)
        errors[name] = {"max_abs_out": float((out - ref_out).abs().max()),
                        "max_abs_grad": float((grad - ref_grad).abs().max())}

    rounds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name in variants:
            times = []
            for _ in range(args.iters):  # the error check above was each variant's warm-up
                start = time.perf_counter()
                step(encoders[name], name, x, lengths, targets, ts, args.max_len, args.max_padding)
                times.append(time.perf_counter() - start)
            rounds[name].append(statistics.median(times) * 1e3)

    layout_ms = []
    for _ in range(5):
        start = time.perf_counter()
        HSTULayout(lengths, targets, ts, args.max_len, args.max_padding)
        layout_ms.append((time.perf_counter() - start) * 1e3)
    base = rounds.get("grouped")
    results = {}
    print(f"{'variant':<12} {'fwd+bwd ms (range)':>22} {'vs grouped':>16} {'max|out-ref|':>13} {'max|grad-ref|':>14}")
    for name in variants:
        ms = rounds[name]
        ratios = [m / b for m, b in zip(ms, base)] if base else []
        results[name] = {"ms": ms, "ratio_to_grouped": ratios, **errors[name]}
        ratio_text = f"{min(ratios):.2f}-{max(ratios):.2f}x" if ratios else "-"
        print(f"{name:<12} {min(ms):>10.1f} - {max(ms):>9.1f} {ratio_text:>16} {errors[name]['max_abs_out']:>13.2e} "
              f"{errors[name]['max_abs_grad']:>14.2e}")
    print(f"layout build (host, grouped): {statistics.median(layout_ms):.1f} ms median")
    write_json_atomic(args.out, {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "lengths": lengths.tolist(), "targets": targets.tolist(),
        "tokens": int(lengths.sum()), "padded_tokens_grouped": sum(
            p * len(m) for p, m in HSTULayout.grouping(lengths.tolist(), args.max_len, args.max_padding)),
        "padded_tokens_dense": int(lengths.max()) * len(lengths),
        "flops_forward": enc.flops(lengths, targets),
        "layout_build_ms": layout_ms, "variants": results,
        "torch": torch.__version__, "threads": torch.get_num_threads(),
    })


if __name__ == "__main__":
    main()
