"""Check `freescale simulate` against this machine: straggler % and exposed communication at
2 and 4 CPU ranks, simulated with parameters measured here, against reference runs of the
shipped experiments in the same job (bench_e2e's runs: 3 repetitions of 40 steps, 8 warm-up,
at 2 and 4 ranks), or against a bench_e2e JSON given with ``--measured FILE``.

The machine's parameters are measured apart from the runs they are checked against:

1. the cost model: ``freescale calibrate`` of the shipped model (forward + backward per sample);
2. per experiment and rank count, a calibration run with a seed of its own (other samples
   than the reference runs') and the ledger on: each rank's step compute against the cost
   model's sum over the samples it trained (regenerated from the data stream, token counts
   checked against the profile), fitted over the rank-steps as ``compute_scale`` x the cost
   model + ``step_overhead_ms`` (the training step's per-sample speed against the
   calibration's, and the pipeline's and exchanges' fixed work on the main thread); within
   each step, the share of the model's difference between the ranks that shows in how late
   each one's compute ends (``imbalance_share``: below 1 where the balancer has evened out
   what the model predicts, leaving what it mispredicts), and each rank's lateness that
   this leaves unpredicted (its compute and its start: a rank that waited for a core starts
   late) as ``jitter_steps``;
   the step records' ``process_cpu`` less ``cpu`` as the CPU the rank's other threads take
   per step (the loader's, gloo's and the proxy's), which competes with the ranks' compute
   for the cores (``background_cpu_ms``);
3. communication, per transport (gloo's ``torch_dist``, ``host_staged``) on 2 and 4
   processes: a small all-to-all for the latency, a large one for the bandwidth (the dense
   all-reduce runs on gloo whatever the transport: ``sim.backend_intra_*``);
4. the host: this machine's cores, time-shared by its ranks (``sim.cores_per_host``).

The simulator then composes them: the split of each global batch, the slowest rank, the
exchanges the pipeline exposes, and the sharing of the cores. What it is checked on is that
composition (straggler % and exposed communication), not the parameters themselves.

A figure passes when the simulated value is within 25% (relative) of the measured mean.

    .venv/bin/python scripts/validate_sim.py --out docs/results/sim_validation.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from freescale.balance.cost import load_cost_model  # noqa: E402
from freescale.config import load_config  # noqa: E402
from freescale.data.loader import build_sources  # noqa: E402
from freescale.io import write_json_atomic  # noqa: E402
from freescale.profile.bubbles import decompose  # noqa: E402
from freescale.train.ledger import read_ledger  # noqa: E402
from freescale.sim.simulator import LengthSampler, simulate_steps, variants  # noqa: E402

sys.path.insert(0, os.path.join(REPO, "scripts"))
import bench_e2e  # noqa: E402

BASELINE = os.path.join(REPO, "configs", "baseline_torchrec.yaml")
FREESCALE = os.path.join(REPO, "configs", "freescale.yaml")
WITHIN = 0.25
METRICS = ("straggler_pct", "exposed_comm_ms")


def run(cmd: list[str]) -> None:
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-2000:]}")


def measure_cost_model(out: str) -> None:
    run([sys.executable, "-m", "freescale", "calibrate", "--config", BASELINE, "--out", out, "--repeats", "3"])


CALIBRATION_SEED = 1000
"""The calibration runs' seed: the reference runs use 0, 1, 2 (their repetitions)."""


def measure_rank_costs(experiment: str, ranks: int, cost_model_path: str, work: str, steps: int = 85,
                       warmup: int = 5) -> dict:
    """One calibration run of ``experiment`` on ``ranks`` ranks, with the ledger on: each rank's
    step compute against the cost model's sum over the samples it trained (the ledger's ids,
    regenerated from the data stream) gives ``compute_scale`` and ``step_overhead_ms`` (the
    fit over the rank-steps), ``imbalance_share`` (within steps) and each rank's lateness that
    leaves unpredicted (``jitter_steps``; their spread, ``compute_jitter``); the step records'
    ``process_cpu`` less ``cpu`` the other threads' CPU (``background_cpu_ms``)."""
    run_dir = os.path.join(work, f"calibrate-{experiment}-{ranks}")
    overrides = [*bench_e2e.common_overrides(steps, warmup), f"--run.seed={CALIBRATION_SEED}", "--train.ledger=true"]
    print(f"[calibrate] {experiment} on {ranks} rank(s)", flush=True)
    bench_e2e.run_once(experiment, str(ranks), run_dir, overrides)
    cfg = load_config(bench_e2e.EXPERIMENTS[experiment], [o.removeprefix("--") for o in overrides])
    source, _ = build_sources(cfg.data, cfg.run.seed)
    model = load_cost_model(cost_model_path)
    records = {}
    for r in range(ranks):
        with open(os.path.join(run_dir, "profile", f"rank{r}.jsonl")) as f:
            records[r] = [x for x in map(json.loads, f) if "step" in x and x["step"] > warmup]
    trained = {(x["step"], x["rank"]): x["sample_ids"] for x in read_ledger(run_dir)}
    background = float(np.mean([x["process_cpu"] - x["cpu"] for recs in records.values() for x in recs]))
    predicted, compute, late = [], [], []
    steps: dict[int, list[int]] = {}
    for s in decompose(records):
        samples = source.samples_at(np.sort(np.asarray(trained[(s.step, s.rank)], dtype=np.int64)))
        if int(samples.uih_lengths.sum()) != s.uih_tokens:
            sys.exit(f"step {s.step} rank {s.rank}: the ledger's samples have {samples.uih_lengths.sum()} tokens, "
                     f"the profile {s.uih_tokens}")
        steps.setdefault(s.step, []).append(len(compute))
        predicted.append(float(model.cost(samples.uih_lengths, samples.cand_counts).sum()))
        compute.append(s.C)
        late.append(s.start + s.D + s.C)  # where the profiler puts the end of the rank's compute
    predicted, compute, late = np.array(predicted), np.array(compute), np.array(late)
    # compute = scale x the cost model + overhead, least squares over the rank-steps: the
    # training step's per-sample speed against the calibration's, and its fixed work.
    scale, overhead = (float(x) for x in np.polyfit(predicted, compute, 1))
    # Within a step: how much of the cost model's difference between the ranks shows in how
    # late each one's compute ends (the slope of the ranks' lateness on their predicted cost,
    # both less the step's mean). A balanced split keeps differences the model mispredicts,
    # so there it shows less than ``scale`` says.
    dev_cost = np.concatenate([predicted[rows] - predicted[rows].mean() for rows in steps.values()])
    dev_late = np.concatenate([late[rows] - late[rows].mean() for rows in steps.values()])
    slope = float(dev_cost @ dev_late / (dev_cost @ dev_cost)) if dev_cost.any() else scale
    # What that leaves unpredicted of each rank's lateness (its compute and its start: a rank
    # that waited for a core starts late), in units of the step's mean rank compute; a step's
    # ranks together, as the simulator draws them (one rank's rare long delay stays one rank's).
    errors = []
    for rows in steps.values():
        e = (late[rows] - late[rows].mean()) - slope * (predicted[rows] - predicted[rows].mean())
        errors.append([round(float(x), 5) for x in e / (scale * predicted[rows].mean())])
    return {"ranks": ranks, "rank_steps": len(compute), "compute_scale": scale, "step_overhead_ms": 1e3 * overhead,
            "imbalance_share": max(slope / scale, 0.0), "compute_jitter": float(np.std(errors)), "jitter_steps": errors,
            "background_cpu_ms": 1e3 * background, "compute_ms": 1e3 * float(compute.mean()),
            "cost_model_ms": 1e3 * float(predicted.mean())}


_COMM_WORKER = r"""
import os, sys, time, torch, torch.distributed as dist
rank, world, path, out, busy, kind, repo = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
                                            float(sys.argv[5]), sys.argv[6], sys.argv[7])
sys.path.insert(0, repo)
from freescale.config import load_config
from freescale.transport.registry import build_transport
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
transport = build_transport(load_config(f"{repo}/configs/freescale.yaml", [f"transport.kind={kind}"]).transport)
a = torch.randn(256, 256)
res = {}
for nbytes, messages in ((1024, 8), (4 << 20, 1)):
    x = torch.zeros(nbytes // 4 // world * world)
    exposed = []
    for i in range(45):
        t0 = time.time()
        while time.time() - t0 < busy:  # compute, as a training step does before it exchanges
            a = (a @ a).clamp_(-1, 1)
        computed = time.time()
        for _ in range(messages):
            transport.all_to_all_single(x, [x.numel() // world] * world, [x.numel() // world] * world).wait()
        done = time.time()
        ends = [None] * world
        dist.all_gather_object(ends, computed)
        exposed.append((done - max(ends)) / messages)  # past the last rank's compute: the exchanges' own time
    kept = sorted(exposed[5:])[2:-2]  # a trimmed mean: the odd descheduled iteration aside
    res[nbytes] = sum(kept) / len(kept)
if rank == 0:
    open(out, "w").write(repr(res))
dist.barrier()  # every rank is done exchanging; the figures are written
os._exit(0)  # no teardown: the measurement needs none, and gloo's can abort a process at exit
"""


def measure_comm(world: int, work: str, kind: str, busy_s: float = 0.03) -> dict:
    """All-to-all latency and bandwidth of transport ``kind`` on ``world`` processes of this
    machine, each round of exchanges after ``busy_s`` of compute, as in a training step."""
    store, out = os.path.join(work, f"store-{kind}-{world}"), os.path.join(work, f"comm-{kind}-{world}.txt")
    procs = [subprocess.Popen([sys.executable, "-c", _COMM_WORKER, str(r), str(world), store, out, str(busy_s), kind,
                               REPO]) for r in range(world)]
    if any(p.wait(timeout=300) for p in procs):
        sys.exit(f"the {kind} all-to-all measurement on {world} processes failed")
    with open(out) as f:
        res = eval(f.read())  # noqa: S307 (our own repr of a dict of floats)
    small, big = res[1024], res[4 << 20]
    rounds = max(1, math.ceil(math.log2(world)))
    moved = (4 << 20) * (world - 1) / world
    return {"latency_us": 1e6 * small / rounds, "bandwidth_gbs": moved / max(big - small, 1e-9) / 1e9,
            "small_ms": 1e3 * small, "big_ms": 1e3 * big}


def measured_rows(path: str) -> dict:
    """{ranks: {variant: {metric: stats}}} of a bench_e2e JSON's synthetic rows."""
    with open(path) as f:
        data = json.load(f)
    return {int(r["layout"]): r["stats"] for r in data["rows"] if r["data"] == "synthetic" and r["layout"].isdigit()}


def measure_reference(ranks: list[int], repeats: int, steps: int, warmup: int, work: str) -> dict:
    """The shipped experiments on this machine now, alternating, as scripts/bench_e2e.py runs them."""
    out = {}
    for R in ranks:
        runs = {e: [] for e in bench_e2e.EXPERIMENTS}
        for rep in range(repeats):
            for e in bench_e2e.EXPERIMENTS:
                r = bench_e2e.run_once(e, str(R), os.path.join(work, f"ref-{R}-{e}-{rep}"),
                                       [*bench_e2e.common_overrides(steps, warmup), f"--run.seed={rep}"])
                runs[e].append(r)
                print(f"[reference] {R} ranks rep {rep} {e:<9} straggler {r['straggler_pct']:5.1f}% | exposed comm "
                      f"{r['exposed_comm_ms']:6.1f} ms", flush=True)
        out[R] = {e: {m: bench_e2e._stats([x[m] for x in rs]) for m in METRICS} for e, rs in runs.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measured", default="", help="a bench_e2e JSON to compare with (default: measure now)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=3, help="reference runs per experiment and rank count")
    parser.add_argument("--train-steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=400, help="simulated steps per layout")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "sim_validation.json"))
    args = parser.parse_args()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        cost_path = os.path.join(work, "cost_model.json")
        measure_cost_model(cost_path)
        machine = {e: {R: measure_rank_costs(e, R, cost_path, work) for R in args.ranks}
                   for e in bench_e2e.EXPERIMENTS}
        comm = {(R, kind): measure_comm(R, work, kind) for R in args.ranks for kind in ("torch_dist", "host_staged")}
        model = load_cost_model(cost_path)
        if args.measured:
            measured = measured_rows(args.measured)
        else:
            measured = measure_reference(args.ranks, args.repeats, args.train_steps, args.warmup, work)
    for e, by_ranks in machine.items():
        for R, v in by_ranks.items():
            print(f"machine {e} {R} rank(s): {json.dumps({k: x for k, x in v.items() if k != 'jitter_steps'})}",
                  flush=True)
    for (R, kind), v in comm.items():
        print(f"comm {kind} {R} ranks: {json.dumps(v)}", flush=True)

    rows, all_pass = [], True
    for R in args.ranks:
        stats = measured.get(R)
        if stats is None:
            sys.exit(f"{args.measured}: no synthetic row for {R} ranks")
        base = [f"sim.ranks_per_host={R}", f"sim.cores_per_host={args.cores}", "sim.overlap_cpu_us=0"]
        sampler = LengthSampler(load_config(FREESCALE, base))
        backend = comm[(R, "torch_dist")]  # gloo: the dense all-reduce's link in both experiments
        for v in variants(load_config(FREESCALE, base)):
            link = comm[(R, v.transport)]  # each experiment's own transport
            own = machine[v.name]
            # The other threads' CPU measured on R ranks covers the overlapped exchanges' threads
            # too, so no per-collective share (sim.overlap_cpu_us) is added to it.
            cfg = load_config(FREESCALE, [*base, f"sim.compute_scale={own[R]['compute_scale']}",
                                          f"sim.step_overhead_ms={own[R]['step_overhead_ms']}",
                                          f"sim.imbalance_share={own[R]['imbalance_share']}",
                                          f"sim.compute_jitter={own[R]['compute_jitter']}",
                                          f"sim.jitter_steps={json.dumps(own[R]['jitter_steps'])}",
                                          f"sim.background_cpu_ms={own[R]['background_cpu_ms']}",
                                          f"sim.intra_latency_us={link['latency_us']}",
                                          f"sim.intra_bandwidth_gbs={link['bandwidth_gbs']}",
                                          f"sim.backend_intra_latency_us={backend['latency_us']}",
                                          f"sim.backend_intra_bandwidth_gbs={backend['bandwidth_gbs']}"])
            # The balancer splits by the cost model its runs use (the experiment's
            # balance.cost_model); the calibrated model prices the samples.
            sim = simulate_steps(cfg, v, R, model, sampler, seed=cfg.run.seed, steps=args.steps,
                                 split_model=load_cost_model(cfg.balance.cost_model))
            for metric in METRICS:
                m = stats[v.name][metric]
                s = getattr(sim, metric)
                err = abs(s - m["mean"]) / m["mean"]
                ok = err <= WITHIN
                all_pass &= ok
                rows.append({"ranks": R, "variant": v.name, "metric": metric, "simulated": s, "measured": m["mean"],
                             "measured_min": m["min"], "measured_max": m["max"], "relative_error": err, "within": ok})

    print(f"\n{'ranks':>5} {'variant':>9} {'metric':>16} {'simulated':>10} {'measured (range)':>24} {'error':>7}")
    for r in rows:
        print(f"{r['ranks']:>5} {r['variant']:>9} {r['metric']:>16} {r['simulated']:>10.2f} "
              f"{r['measured']:>8.2f} ({r['measured_min']:.2f}-{r['measured_max']:.2f}) {100 * r['relative_error']:>6.1f}% "
              f"{'ok' if r['within'] else 'OUTSIDE'}")
    print(f"\nall within {100 * WITHIN:.0f}%: {all_pass}")
    write_json_atomic(args.out, {"within": WITHIN, "all_within": all_pass,
                                 "machine": {e: {str(R): v for R, v in rs.items()} for e, rs in machine.items()},
                                 "comm": {f"{kind} {R} ranks": v for (R, kind), v in comm.items()}, "cores_per_host": args.cores,
                                 "measured_from": os.path.relpath(args.measured, REPO) if args.measured else
                                 f"this job: {args.repeats} runs per experiment, {args.train_steps} steps, "
                                 f"{args.warmup} warm-up", "rows": rows,
                                 "seconds": round(time.perf_counter() - t_start, 1)})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
