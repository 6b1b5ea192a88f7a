"""TorchRec's PEC modules train other numbers than the standard row-wise EmbeddingCollection.

    python scripts/pec_repro.py [--steps 20] [--features 2] [--out PATH]

Self-contained (torch, torchrec, fbgemm-gpu; nothing of FreeScale's): 2 gloo ranks on CPU, in
seconds. Each rank trains the same batches three ways, from the same rows:

- ``standard``: a row-wise sharded ``EmbeddingCollection`` (DMP), its forward called directly;
- ``pec as shipped``: the same table in ``PECEmbeddingCollection``, sharded by
  ``PECEmbeddingCollectionSharder``, driven by hand through PEC's API (``input_dist``,
  ``overlap_dist``, ``compute_and_output_dist_in_partition`` for the overlapping and the other
  rows, ``merge_partitioned_embeddings``, backward, ``grad_dist`` and its awaitables, which
  apply the gradients through ``PECGradientApply.apply``);
- ``pec corrected``: the same, each partition's received gradient applied after two
  corrections, as ``All2All_Seq_Req.backward`` treats the standard path's:
  (1) its rows put back from rank-major to the lookup's feature-major order (with one feature
  the two agree; with more, PEC applies each row's gradient to another row), and
  (2) divided by the group's size (``comm_ops.GRADIENT_DIVISION``, on by default).

The table (two features on it by default), fused row-wise Adagrad, and a loss whose gradient
depends on the rows. Every step compares the losses, the rows and Adagrad's state bit for
bit against ``standard`` and prints a table; the corrected run is bitwise equal, the shipped one
diverges from step 2 (its Adagrad state is world_size^2 times the standard's while the
gradients are still in the same order, as with ``--features 1``). Exits 0 when the corrected
run matches and the shipped one does not (what this reports), 1 otherwise. ``--out`` writes
the per-step figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

WORLD = 2
ROWS, DIM, BATCH, MAX_LEN = 64, 8, 4, 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Holder(nn.Module):
    """DMP shards the collection ``ec`` of this module."""

    def __init__(self, ec: nn.Module) -> None:
        super().__init__()
        self.ec = ec


def build(features: list[str], pec: bool):
    """A DMP over one table read by ``features``, row-wise, row-wise Adagrad fused (lr 0.1)."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.pec_embedding import PECEmbeddingCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingEnv, ShardingType
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection
    from torchrec.modules.pec_embedding_modules import PECEmbeddingCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    ec = EmbeddingCollection(tables=[EmbeddingConfig(name="t0", embedding_dim=DIM, num_embeddings=ROWS,
                                                     feature_names=features)], device=torch.device("meta"))
    apply_optimizer_in_backward(RowWiseAdagrad, ec.parameters(), {"lr": 0.1})
    module = Holder(PECEmbeddingCollection(ec) if pec else ec)
    sharders = [PECEmbeddingCollectionSharder() if pec else EmbeddingCollectionSharder()]
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=WORLD, compute_device="cpu"),
        constraints={"t0": ParameterConstraints(sharding_types=[ShardingType.ROW_WISE.value])})
    plan = planner.collective_plan(module, sharders, dist.GroupMember.WORLD)
    return DistributedModelParallel(module, env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
                                    device=torch.device("cpu"), plan=plan, sharders=sharders)


def local_rows(model) -> torch.Tensor:
    """This rank's shard of the table."""
    for name, value in model.state_dict().items():
        if name.endswith("t0.weight"):
            return value.local_shards()[0].tensor
    raise KeyError("t0.weight")


def adagrad_state(model) -> torch.Tensor:
    """This rank's row-wise Adagrad state of the table."""
    for per_key in model.fused_optimizer.state_dict()["state"].values():
        for value in per_key.values():
            if torch.is_tensor(value):
                return value.local_shards()[0].tensor if hasattr(value, "local_shards") else value
    raise KeyError("momentum")


def batches(rank: int, steps: int, features: list[str]):
    """``steps + 1`` KJTs for this rank: ids from a small vocabulary, so consecutive batches share rows."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(steps + 1):
        lengths = torch.randint(0, MAX_LEN + 1, (len(features) * BATCH,), generator=g)
        values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
        out.append(KeyedJaggedTensor.from_lengths_sync(keys=features, values=values, lengths=lengths))
    return out


def loss_of(embeddings: dict, features: list[str]) -> torch.Tensor:
    """A loss whose gradient depends on each row's values and its feature."""
    return sum(((i + 1) * jt.values() ** 2 + jt.values()).sum() for i, jt in
               enumerate(embeddings[f] for f in features))


def corrected_apply(pec, applier, features, sharding_ctx, world: int) -> None:
    """``PECGradientApply.apply``, with the standard path's reordering and division."""
    from torchrec.distributed.comm_ops import get_gradient_division

    ec = pec._embedding_collection
    sharding_type = next(iter(ec._sharding_type_to_sharding))
    dim = ec._embedding_dim_for_sharding_type(sharding_type)
    applier._work.wait()
    grad = applier._grad_buffer.view(-1, dim)
    # (1) rank-major -> feature-major: the inverse of the order TorchRec's sequence all-to-all sends in.
    to_ranks = torch.ops.fbgemm.invert_permute(sharding_ctx.sparse_features_recat)
    rows = torch.arange(grad.shape[0], dtype=torch.int64)
    _, order, _ = torch.ops.fbgemm.permute_2D_sparse_data(to_ranks, features.lengths().view(to_ranks.numel(), -1),
                                                          rows, None, rows.numel())
    grad = torch.empty_like(grad).index_copy_(0, order, grad)
    # (2) divided by the group's size, as All2All_Seq_Req.backward does.
    if get_gradient_division():
        grad = grad.div_(world)
    if features.values().numel() > 0:
        with torch.enable_grad():
            embs = ec._lookups[0](features).view(-1, dim)
            if embs.numel() > 0:
                embs.backward(grad)
    applier._work = applier._grad_buffer = None


class PECDriver:
    """PEC's API driven by hand, one step at a time; every gradient applied before the next
    lookup (PEC's schedule defers some: that changes when, not what)."""

    def __init__(self, model, features: list[str], kjts: list, corrected: bool) -> None:
        self.pec, self.features, self.kjts, self.corrected = model.module.ec, features, kjts, corrected
        self.ctx, self.input = self._input_dist(kjts[0])
        self.forward = self._overlap(self.ctx, self.input, None, None)[0]

    def _input_dist(self, kjt):
        ctx = self.pec.create_context()
        return ctx, self.pec.input_dist(ctx, kjt).wait().wait()

    def _overlap(self, ctx, dist_input, prev_ctx, prev_input):
        out = [r.wait() for r in self.pec.overlap_dist(ctx=ctx, dist_input=dist_input, prev_ctx=prev_ctx,
                                                       prev_dist_input=prev_input)]
        return [f for f, _ in out if f is not None], [b for _, b in out if b is not None]

    def step(self, n: int) -> float:
        last = n + 1 >= len(self.kjts)
        nxt_ctx, nxt_input = (None, None) if last else self._input_dist(self.kjts[n + 1])
        nxt_forward, backward = self._overlap(nxt_ctx, nxt_input, self.ctx, self.input)
        fwd = self.forward[0]
        ol = self.pec.compute_and_output_dist_in_partition(self.ctx, fwd.ol_features, fwd.splits, is_overlapped=True)
        nol = self.pec.compute_and_output_dist_in_partition(self.ctx, fwd.nol_features, fwd.splits,
                                                            is_overlapped=False)
        embeddings = self.pec.merge_partitioned_embeddings(self.ctx, ol, nol, self.forward, backward).wait()
        loss = loss_of(embeddings, self.features)
        loss.backward()
        for overlapped in (True, False):
            parts = [b.ol_features if overlapped else b.nol_features for b in backward]
            if self.corrected:
                for info, part, sctx in zip(self.ctx.autograd_ctx_per_sharding, parts, self.ctx.sharding_contexts):
                    applier = info.ol_grad_apply if overlapped else info.nol_grad_apply
                    applier.dist()
                    corrected_apply(self.pec, applier, part, sctx, WORLD)
            else:
                from torchrec.distributed.embedding_types import KJTList

                for aw in self.pec.grad_dist(self.ctx, KJTList(parts), is_overlapped=overlapped):
                    aw.wait()
        self.ctx, self.input, self.forward = nxt_ctx, nxt_input, nxt_forward
        return loss.item()


def _rank(rank: int, port: int, steps: int, nfeatures: int, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    features = [f"f{i}" for i in range(nfeatures)]
    kjts = batches(rank, steps, features)[:steps]
    runs = {"standard": build(features, pec=False), "pec as shipped": build(features, pec=True),
            "pec corrected": build(features, pec=True)}
    with torch.no_grad():
        for name in ("pec as shipped", "pec corrected"):
            local_rows(runs[name]).copy_(local_rows(runs["standard"]))
    drivers = {name: PECDriver(runs[name], features, kjts, corrected=name == "pec corrected")
               for name in ("pec as shipped", "pec corrected")}
    records = []
    for n in range(steps):
        losses = {"standard": loss_of(runs["standard"].module.ec(kjts[n]).wait(), features)}
        losses["standard"].backward()
        losses = {"standard": losses["standard"].item(),
                  **{name: driver.step(n) for name, driver in drivers.items()}}
        ref_rows, ref_state = local_rows(runs["standard"]), adagrad_state(runs["standard"])
        record = {"step": n + 1, "loss": losses}
        for name in drivers:
            rows, state = local_rows(runs[name]), adagrad_state(runs[name])
            record[name] = {
                "loss_equal": losses[name] == losses["standard"],
                "rows_equal": torch.equal(rows, ref_rows),
                "state_equal": torch.equal(state, ref_state),
                "max_row_diff": float((rows - ref_rows).abs().max()),
                "state_ratio": float(state.sum() / ref_state.sum()) if ref_state.sum() > 0 else 1.0,
            }
        records.append(record)
    everywhere = torch.tensor([[r[name][k] for name in drivers for k in ("loss_equal", "rows_equal", "state_equal")]
                               for r in records], dtype=torch.float64)
    dist.all_reduce(everywhere, op=dist.ReduceOp.MIN)  # equal on every rank
    for r, eq in zip(records, everywhere.tolist()):
        for i, name in enumerate(drivers):
            r[name]["all_ranks_equal"] = all(eq[3 * i:3 * i + 3])
    if rank == 0:
        queue.put(records)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--features", type=int, default=2, help="features on the one table (default 2)")
    parser.add_argument("--out", default="", help="write the per-step figures as JSON here")
    args = parser.parse_args()
    if args.steps < 2 or args.features < 1:
        print("pec_repro: expected --steps >= 2 and --features >= 1", file=sys.stderr)
        return 2
    import torchrec

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, args.steps, args.features, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    records = queue.get()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        print("pec_repro: a rank failed", file=sys.stderr)
        return 1
    print(f"torchrec {torchrec.__version__}, {WORLD} gloo ranks on CPU, one table of {ROWS} rows x {DIM}, "
          f"{args.features} feature(s) on it, row-wise Adagrad (rank 0's losses)")
    print(f"{'step':>4} {'standard':>12} {'pec as shipped':>15} {'pec corrected':>14}  shipped: rows/state  "
          f"Adagrad state / standard   corrected: all bitwise")
    for r in records:
        s, c = r["pec as shipped"], r["pec corrected"]
        print(f"{r['step']:>4} {r['loss']['standard']:>12.6f} {r['loss']['pec as shipped']:>15.6f} "
              f"{r['loss']['pec corrected']:>14.6f}  {'equal' if s['rows_equal'] else 'differ':>6}/"
              f"{'equal' if s['state_equal'] else 'differ':<6}  {s['state_ratio']:>12.3f}          "
              f"{'yes' if c['all_ranks_equal'] else 'NO'}")
    corrected = all(r["pec corrected"]["all_ranks_equal"] for r in records)
    shipped = all(r["pec as shipped"]["all_ranks_equal"] for r in records)
    print(f"pec corrected: {'bitwise equal to the standard path' if corrected else 'DIFFERS'} over {args.steps} steps; "
          f"pec as shipped: {'equal' if shipped else 'differs'}")
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"torchrec": torchrec.__version__, "features": args.features, "steps": records}, f, indent=1)
        os.replace(tmp, args.out)
    return 0 if corrected and not shipped else 1


if __name__ == "__main__":
    sys.exit(main())
