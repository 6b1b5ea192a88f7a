"""Dense memory per rank and bytes per rank across replica groups, ``dense.sharding`` fsdp against replicate.

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_dense_sharding.py [--config configs/ft_local.yaml]
        [--groups 2] [--ranks 2] [--set section.key=value ...] [--out runs/bench_dense_sharding.json]

``--groups`` x ``--ranks`` gloo processes on this host, each group's ranks in a process group of
their own, rank r of every group in a cross-group one (as the replica layer pairs them). For each
sharding, every rank builds the config's model for FreeScale's own tables
(``freescale.embedding.pipeline.build_owned_model``: the task sharded as ``dense.sharding`` says)
and its dense optimizer, takes one optimizer step (so the optimizer's state exists), and counts
what it holds of the dense part: the parameters' and the optimizer state's bytes (a DTensor's local
shard). It then makes the gradients the replica layer reduces across the groups
(``freescale.model.dense_sharding.local_gradients``, what ``ReplicaLayer.reduce_dense`` flattens)
and all-reduces them over the cross-group process group, counting the payload: the bytes each rank
hands the cross-group all-reduce per step (gloo's ring sends about 2(R-1)/R of it for R groups).
Per sharding the largest figure over the ranks; the table shows both shardings and fsdp/replicate.
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
from torch.distributed.tensor import DTensor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

SHARDINGS = ("replicate", "fsdp")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _measure(rank: int, groups: int, ranks: int, config: str, overrides: list[str], port: int, out) -> None:
    from freescale.config import load_config
    from freescale.distributed import Topology
    from freescale.embedding.pipeline import build_owned_model
    from freescale.model.dense_sharding import local_gradients
    from freescale.model.sharding import build_dense_optimizer, init_dense_state

    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=groups * ranks)
    group_pg, _ = dist.new_subgroups_by_enumeration([list(range(g * ranks, (g + 1) * ranks)) for g in range(groups)])
    across, _ = dist.new_subgroups_by_enumeration([list(range(r, groups * ranks, ranks)) for r in range(ranks)])
    replica, local_rank = divmod(rank, ranks)
    topo = Topology(rank=local_rank, world_size=ranks, local_rank=rank, local_world_size=groups * ranks,
                    replica_id=replica, num_replicas=groups, group=group_pg)
    result = {}
    for sharding in SHARDINGS:
        cfg = load_config(config, [*overrides, "--ft.enable=false", f"--dense.sharding={sharding}"])
        torch.manual_seed(cfg.run.seed)
        model = build_owned_model(cfg, num_items=cfg.data.synthetic.num_items, max_uih_len=cfg.data.max_uih_len,
                                  topology=topo, seed=cfg.run.seed)
        optimizer = build_dense_optimizer(model.task, cfg.train)
        init_dense_state(optimizer)  # one step with zero gradients: the optimizer's state exists
        params = [p for p in model.task.parameters() if p.requires_grad]
        state = [v for s in optimizer.state_dict()["state"].values() for v in s.values()
                 if torch.is_tensor(v) and v.dim()]
        grads = local_gradients(params)
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=across)  # the layer's cross-group reduction of what this rank holds
        result[sharding] = {"dense_param_bytes": _bytes(params), "dense_optimizer_bytes": _bytes(state),
                            "cross_group_bytes_per_step": flat.numel() * flat.element_size(),
                            "whole_dense_param_bytes": sum(p.numel() * p.element_size() for p in params)}
    gathered = [None] * (groups * ranks)
    dist.all_gather_object(gathered, result)
    if rank == 0:
        out.put(gathered)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(REPO, "configs", "ft_local.yaml"))
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "bench_dense_sharding.json"))
    args = parser.parse_args()
    overrides = [f"--{o.lstrip('-')}" for o in args.overrides]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    world = args.groups * args.ranks
    procs = [ctx.Process(target=_measure, args=(r, args.groups, args.ranks, args.config, overrides, port, out))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs) or out.empty():
        sys.exit(f"a rank failed (exit codes {[p.exitcode for p in procs]})")
    per_rank = out.get()
    worst = {s: {k: max(r[s][k] for r in per_rank) for k in per_rank[0][s]} for s in SHARDINGS}
    report = {"config": args.config, "overrides": overrides, "groups": args.groups, "ranks_per_group": args.ranks,
              "per_rank": per_rank, "max_over_ranks": worst,
              "ratio_fsdp_over_replicate": {k: round(worst["fsdp"][k] / worst["replicate"][k], 4)
                                            for k in worst["fsdp"] if k != "whole_dense_param_bytes"}}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"{args.groups} groups x {args.ranks} ranks, dense part {worst['replicate']['whole_dense_param_bytes']} "
          f"bytes ({args.config})")
    print(f"{'per rank (max over ranks)':34} {'replicate':>12} {'fsdp':>12} {'fsdp/replicate':>15}")
    for key, label in (("dense_param_bytes", "dense parameters (bytes)"),
                       ("dense_optimizer_bytes", "dense optimizer state (bytes)"),
                       ("cross_group_bytes_per_step", "cross-group all-reduce (bytes/step)")):
        print(f"{label:34} {worst['replicate'][key]:>12} {worst['fsdp'][key]:>12} "
              f"{report['ratio_fsdp_over_replicate'][key]:>15.4f}")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
