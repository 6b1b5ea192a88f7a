"""Check `freescale simulate` against this machine: straggler % and exposed communication at
2 and 4 CPU ranks, simulated with parameters measured here, against reference runs of the
shipped experiments in the same job (bench_e2e's runs: 3 repetitions of 40 steps, 8 warm-up,
at 2 and 4 ranks), or against a bench_e2e JSON given with ``--measured FILE``.

The machine's parameters are measured apart from the runs they are checked against:

1. the cost model: ``freescale calibrate`` of the shipped model (forward + backward per sample);
2. per-step overhead and jitter: a one-rank run of configs/baseline_torchrec.yaml, one thread;
   its batches are regenerated from the data stream (their token counts checked against the
   profile), and each step's compute is compared with the cost model's sum over its samples:
   overhead = mean difference, jitter = their spread relative to the step's compute; the
   rank's other threads' CPU per step is its records' ``process_cpu`` less ``cpu``;
3. communication, per transport (gloo's ``torch_dist``, ``host_staged``) on 2 and 4
   processes: a small all-to-all for the latency, a large one for the bandwidth, and how much
   a fixed compute slows down beside overlapped all-to-alls (the CPU their threads take from
   the ranks' cores, per collective: ``sim.overlap_cpu_us``);
4. the host: this machine's cores, time-shared by its ranks (``sim.cores_per_host``).

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


def one_rank(run_dir: str, steps: int, warmup: int) -> None:
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "freescale",
         "train", "--config", BASELINE, f"--train.steps={steps}", "--run.threads=1", f"--run.dir={run_dir}",
         "--train.eval_every=0", "--checkpoint.every=0", "--profile.enable=true", f"--profile.warmup_steps={warmup}"])


def measure_overhead(cost_model_path: str, work: str, steps: int = 30, warmup: int = 5) -> dict:
    """Per-step compute outside the cost model, its jitter, and the CPU the rank's other threads
    take per step (the loader's and the like: each step record's ``process_cpu`` less its main
    thread's ``cpu``), from a one-rank run."""
    run_dir = os.path.join(work, "one_rank")
    one_rank(run_dir, steps, warmup)
    cfg = load_config(BASELINE, [])
    source, _ = build_sources(cfg.data, cfg.run.seed)
    model = load_cost_model(cost_model_path)
    with open(os.path.join(run_dir, "profile", "rank0.jsonl")) as f:
        records = [r for r in map(json.loads, f) if "step" in r]
    B = cfg.data.batch_size
    background = float(np.mean([r["process_cpu"] - r["cpu"] for r in records if r["step"] > warmup]))
    predicted, compute = [], []
    for s in decompose({0: records}):
        if s.step <= warmup:
            continue
        batch = source.samples_at(np.arange((s.step - 1) * B, s.step * B))
        if int(batch.uih_lengths.sum()) != s.uih_tokens:
            sys.exit(f"step {s.step}: regenerated batch has {batch.uih_lengths.sum()} tokens, the run {s.uih_tokens}")
        predicted.append(float(model.cost(batch.uih_lengths, batch.cand_counts).sum()))
        compute.append(s.C)
    predicted, compute = np.array(predicted), np.array(compute)
    overhead = float(np.mean(compute - predicted))
    jitter = float(np.std(compute - predicted - overhead) / np.mean(compute))
    return {"step_overhead_ms": 1e3 * overhead, "compute_jitter": jitter, "background_cpu_ms": 1e3 * background,
            "steps": len(compute),
            "compute_ms": 1e3 * float(compute.mean()), "cost_model_ms": 1e3 * float(predicted.mean())}


OVERLAP_BYTES, OVERLAP_MESSAGES = 64 << 10, 4
"""Exchanges overlapped with compute in the overlap measurement: the size of a step's
overlapped id and row exchanges here, and how many a step has."""

_COMM_WORKER = r"""
import sys, time, torch, torch.distributed as dist
OVERLAP_BYTES, OVERLAP_MESSAGES, WORK = OVERLAP_ARGS
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
for nbytes, messages in ((1024, 8), (OVERLAP_BYTES, OVERLAP_MESSAGES), (4 << 20, 1)):
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
# Overlap: the same fixed compute alone, and with exchanges launched before it and waited
# after it (as the pipelines overlap them); the compute's slowdown is the CPU they took.
x = torch.zeros(OVERLAP_BYTES // 4 // world * world)
splits = [x.numel() // world] * world
alone, beside = [], []
for i in range(60):
    dist.barrier()
    handles = [transport.all_to_all_single(x, splits, splits) for _ in range(OVERLAP_MESSAGES)] if i % 2 else []
    t0 = time.perf_counter()
    for _ in range(WORK):
        a = (a @ a).clamp_(-1, 1)
    (beside if i % 2 else alone).append(time.perf_counter() - t0)
    for h in handles:
        h.wait()
trim = lambda v: sorted(v[3:])[2:-2]
res["slowdown"] = (sum(trim(beside)) / len(trim(beside)) - sum(trim(alone)) / len(trim(alone))) / OVERLAP_MESSAGES
if rank == 0:
    open(out, "w").write(repr(res))
transport.close()
dist.destroy_process_group()
"""


def measure_comm(world: int, work: str, kind: str, busy_s: float = 0.03) -> dict:
    """All-to-all latency and bandwidth of transport ``kind`` on ``world`` processes of this
    machine, each round of exchanges after ``busy_s`` of compute, as in a training step."""
    store, out = os.path.join(work, f"store-{kind}-{world}"), os.path.join(work, f"comm-{kind}-{world}.txt")
    worker = _COMM_WORKER.replace("OVERLAP_ARGS", f"{OVERLAP_BYTES}, {OVERLAP_MESSAGES}, 150")
    procs = [subprocess.Popen([sys.executable, "-c", worker, str(r), str(world), store, out, str(busy_s), kind,
                               REPO]) for r in range(world)]
    if any(p.wait(timeout=300) for p in procs):
        sys.exit(f"the {kind} all-to-all measurement on {world} processes failed")
    with open(out) as f:
        res = eval(f.read())  # noqa: S307 (our own repr of a dict of floats)
    small, big = res[1024], res[4 << 20]
    rounds = max(1, math.ceil(math.log2(world)))
    moved = (4 << 20) * (world - 1) / world
    return {"latency_us": 1e6 * small / rounds, "bandwidth_gbs": moved / max(big - small, 1e-9) / 1e9,
            "small_ms": 1e3 * small, "big_ms": 1e3 * big, "overlap_ms": 1e3 * res[OVERLAP_BYTES],
            "overlap_cpu_us": max(1e6 * res["slowdown"], 0.0)}


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
        machine = measure_overhead(cost_path, work)
        comm = {(R, kind): measure_comm(R, work, kind) for R in args.ranks for kind in ("torch_dist", "host_staged")}
        model = load_cost_model(cost_path)
        if args.measured:
            measured = measured_rows(args.measured)
        else:
            measured = measure_reference(args.ranks, args.repeats, args.train_steps, args.warmup, work)
    print(f"machine: {json.dumps(machine)}", flush=True)
    for (R, kind), v in comm.items():
        print(f"comm {kind} {R} ranks: {json.dumps(v)}", flush=True)

    rows, all_pass = [], True
    for R in args.ranks:
        stats = measured.get(R)
        if stats is None:
            sys.exit(f"{args.measured}: no synthetic row for {R} ranks")
        overrides = [f"sim.ranks_per_host={R}", f"sim.cores_per_host={args.cores}",
                     f"sim.step_overhead_ms={machine['step_overhead_ms']}",
                     f"sim.compute_jitter={machine['compute_jitter']}",
                     f"sim.background_cpu_ms={machine['background_cpu_ms']}"]
        sampler = LengthSampler(load_config(FREESCALE, overrides))
        for v in variants(load_config(FREESCALE, overrides)):
            link = comm[(R, v.transport)]  # each experiment's own transport
            cfg = load_config(FREESCALE, [*overrides, f"sim.intra_latency_us={link['latency_us']}",
                                          f"sim.intra_bandwidth_gbs={link['bandwidth_gbs']}",
                                          f"sim.overlap_cpu_us={link['overlap_cpu_us']}"])
            sim = simulate_steps(cfg, v, R, model, sampler, seed=cfg.run.seed, steps=args.steps)
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
    write_json_atomic(args.out, {"within": WITHIN, "all_within": all_pass, "machine": machine,
                                 "comm": {f"{kind} {R} ranks": v for (R, kind), v in comm.items()}, "cores_per_host": args.cores,
                                 "measured_from": os.path.relpath(args.measured, REPO) if args.measured else
                                 f"this job: {args.repeats} runs per experiment, {args.train_steps} steps, "
                                 f"{args.warmup} warm-up", "rows": rows,
                                 "seconds": round(time.perf_counter() - t_start, 1)})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
