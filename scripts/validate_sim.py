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

The shaped-link experiment (``--link-gbit 2 3``; ``--only link`` runs it alone; needs root):
``configs/bench_embedding.yaml`` on 2 hosts of one rank each, joined by a link shaped to each
rate (``scripts/shaped_hosts.py``), TorchRec's ``sparse_dist`` (the simulator's baseline)
against the ``prioritized`` pipeline over ``torch_dist`` (its "freescale" variant), on
exposed communication and step time. Measured apart: the cost model of that model
(``freescale calibrate``); per pipeline, a calibration run on the shaped hosts (as in 2.; its
collision rate too); per rate, gloo's all-to-all across the link at a small size and at the
size of a step's row exchange (latency and bandwidth, ``sim.inter_*``); one rank and one core
per host (``sim.ranks_per_host``, ``sim.cores_per_host``). The reference runs (3 per pipeline
and rate, alternating) are measured in the same job, or read from a ``bench_embedding_comm.py
--hosts 2`` JSON given with ``--link-measured FILE``.
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
from freescale.progress import bar, say  # noqa: E402
from freescale.data.loader import build_sources  # noqa: E402
from freescale.io import write_json_atomic  # noqa: E402
from freescale.profile.bubbles import decompose  # noqa: E402
from freescale.train.ledger import read_ledger  # noqa: E402
from freescale.sim.simulator import LengthSampler, simulate_steps, variants  # noqa: E402

sys.path.insert(0, os.path.join(REPO, "scripts"))
import bench_e2e  # noqa: E402
import bench_embedding_comm  # noqa: E402
from shaped_hosts import ShapedHosts, available  # noqa: E402

BASELINE = os.path.join(REPO, "configs", "baseline_torchrec.yaml")
FREESCALE = os.path.join(REPO, "configs", "freescale.yaml")
WITHIN = 0.25
METRICS = ("straggler_pct", "exposed_comm_ms")
LINK_CONFIG = bench_embedding_comm.CONFIG
LINK_PIPELINES = {"baseline": "sparse_dist", "freescale": "prioritized"}
"""The simulator's variants of the shaped-link experiment, and the pipeline each runs."""
LINK_METRICS = ("exposed_comm_ms", "step_ms")
LINK_TRANSPORT = "torch_dist"


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
    """One calibration run of ``experiment`` on ``ranks`` ranks, with the ledger on, fitted by ``fit_rank_costs``."""
    run_dir = os.path.join(work, f"calibrate-{experiment}-{ranks}")
    overrides = [*bench_e2e.common_overrides(steps, warmup), f"--run.seed={CALIBRATION_SEED}", "--train.ledger=true"]
    print(f"[calibrate] {experiment} on {ranks} rank(s)", flush=True)
    bench_e2e.run_once(experiment, str(ranks), run_dir, overrides)
    cfg = load_config(bench_e2e.EXPERIMENTS[experiment], [o.removeprefix("--") for o in overrides])
    return fit_rank_costs(run_dir, cfg, ranks, load_cost_model(cost_model_path), warmup)


def fit_rank_costs(run_dir: str, cfg, ranks: int, model, warmup: int) -> dict:
    """A calibration run's ranks' step compute against the cost model's sum over the samples
    each trained (the ledger's ids, regenerated from the data stream): ``compute_scale`` and
    ``step_overhead_ms`` (the fit over the rank-steps), ``imbalance_share`` (within steps) and
    each rank's lateness that leaves unpredicted (``jitter_steps``; their spread,
    ``compute_jitter``); the step records' ``process_cpu`` less ``cpu`` the other threads' CPU
    (``background_cpu_ms``)."""
    source, _ = build_sources(cfg.data, cfg.run.seed, task=cfg.task)
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
        late.append(s.start + s.D + s.C + s.R)  # where the profiler puts the end of the rank's compute
    predicted, compute, late = np.array(predicted), np.array(compute), np.array(late)
    # compute = scale x the cost model + overhead, least squares over the rank-steps: the
    # training step's per-sample speed against the calibration's, and its fixed work.
    # The fixed work cannot be negative: where the free fit says it is (rank-steps whose
    # predicted costs differ too little to pin the line), the best fit with none goes through 0.
    scale, overhead = (float(x) for x in np.polyfit(predicted, compute, 1))
    if overhead < 0:
        scale, overhead = float(predicted @ compute / (predicted @ predicted)), 0.0
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
rank, world, path, out, busy, kind, repo, big = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
                                                 float(sys.argv[5]), sys.argv[6], sys.argv[7], int(sys.argv[8]))
sys.path.insert(0, repo)
from freescale.config import load_config
from freescale.transport.registry import build_transport
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
transport = build_transport(load_config(f"{repo}/configs/freescale.yaml", [f"transport.kind={kind}",
                                                                          f"transport.host_name=h{rank}"]).transport)
a = torch.randn(256, 256)
res = {}
for nbytes, messages in ((1024, 8), (big, 1)):
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
    res["small" if nbytes == 1024 else "big"] = sum(kept) / len(kept)
if rank == 0:
    open(out, "w").write(repr(res))
dist.barrier()  # every rank is done exchanging; the figures are written
os._exit(0)  # no teardown: the measurement needs none, and gloo's can abort a process at exit
"""


def measure_comm(world: int, work: str, kind: str, busy_s: float = 0.03, big: int = 4 << 20, hosts=None) -> dict:
    """All-to-all latency and bandwidth of transport ``kind`` on ``world`` processes of this
    machine (one per shaped host, with ``hosts``), each round of exchanges after ``busy_s`` of
    compute, as in a training step; the bandwidth from ``big`` bytes per rank."""
    tag = f"{kind}-{world}" + (f"-{hosts.gbit:g}gbit" if hosts else "")
    store, out = os.path.join(work, f"store-{tag}"), os.path.join(work, f"comm-{tag}.txt")
    cmds = [[sys.executable, "-c", _COMM_WORKER, str(r), str(world), store, out, str(busy_s), kind, REPO, str(big)]
            for r in range(world)]
    procs = [subprocess.Popen(hosts.command(r, cmd) if hosts else cmd) for r, cmd in enumerate(cmds)]
    if any(p.wait(timeout=300) for p in procs):
        sys.exit(f"the {kind} all-to-all measurement on {world} processes failed")
    with open(out) as f:
        res = eval(f.read())  # noqa: S307 (our own repr of a dict of floats)
    small, large = res["small"], res["big"]
    rounds = max(1, math.ceil(math.log2(world)))
    moved = big * (world - 1) / world
    return {"latency_us": 1e6 * small / rounds, "bandwidth_gbs": moved / max(large - small, 1e-9) / 1e9,
            "small_ms": 1e3 * small, "big_ms": 1e3 * large, "big_bytes": big}


def measured_rows(path: str) -> dict:
    """{ranks: {variant: {metric: stats}}} of a bench_e2e JSON's synthetic rows."""
    with open(path) as f:
        data = json.load(f)
    return {int(r["layout"]): r["stats"] for r in data["rows"] if r["data"] == "synthetic" and r["layout"].isdigit()}


def measure_reference(ranks: list[int], repeats: int, steps: int, warmup: int, work: str) -> dict:
    """The shipped experiments on this machine now, alternating, as scripts/bench_e2e.py runs them."""
    out = {}
    progress = bar(total=len(ranks) * repeats * len(bench_e2e.EXPERIMENTS), desc="reference runs", unit="run")
    for R in ranks:
        runs = {e: [] for e in bench_e2e.EXPERIMENTS}
        for rep in range(repeats):
            for e in bench_e2e.EXPERIMENTS:
                r = bench_e2e.run_once(e, str(R), os.path.join(work, f"ref-{R}-{e}-{rep}"),
                                       [*bench_e2e.common_overrides(steps, warmup), f"--run.seed={rep}"])
                runs[e].append(r)
                progress.update()
                say(progress, f"[reference] {R} ranks rep {rep} {e:<9} straggler {r['straggler_pct']:5.1f}% | exposed "
                    f"comm {r['exposed_comm_ms']:6.1f} ms")
        out[R] = {e: {m: bench_e2e._stats([x[m] for x in rs]) for m in METRICS} for e, rs in runs.items()}
    progress.close()
    return out


# The shaped-link experiment ---------------------------------------------------------------------


def link_row_bytes(cfg) -> int:
    """One rank's bytes of a step's row exchange: its tokens (mean history and candidates) times a row."""
    lengths, cands = LengthSampler(cfg).draw(np.random.default_rng(0), 4096)
    return int(cfg.data.batch_size * float(np.mean(lengths + cands)) * cfg.model.embedding_dim * 4)


def link_measured_rows(path: str) -> dict:
    """{link rate: {variant: {metric: stats}}} of a ``bench_embedding_comm.py --hosts 2`` JSON."""
    with open(path) as f:
        data = json.load(f)
    if not data.get("hosts"):
        sys.exit(f"{path}: not a run on shaped hosts (bench_embedding_comm.py --hosts 2)")
    return {float(row["link_gbit"]): {v: row["stats"][p] for v, p in LINK_PIPELINES.items()}
            for row in [*data["low_collision"], *data.get("link_sweep", [])]}


def measure_link(rates: list[float], cost_path: str, work: str, repeats: int, steps: int, warmup: int,
                 measured: dict | None) -> dict:
    """Per link rate: gloo's all-to-all across the link and (without ``measured``) the reference
    runs; at the first rate, one calibration run per pipeline."""
    cfg = load_config(LINK_CONFIG, [f"transport.kind={LINK_TRANSPORT}"])
    model = load_cost_model(cost_path)
    big = link_row_bytes(cfg)
    out: dict = {"comm": {}, "calibration": {}, "measured": {}}
    for gbit in rates:
        with ShapedHosts(2, gbit, cpus=[[0], [1]]) as hosts:
            out["comm"][gbit] = measure_comm(2, work, LINK_TRANSPORT, big=big, hosts=hosts)
            print(f"[link {gbit:g} Gbit/s] all-to-all: {json.dumps(out['comm'][gbit])}", flush=True)
            if not out["calibration"]:
                for v, pipeline in LINK_PIPELINES.items():
                    run_dir = os.path.join(work, f"calibrate-link-{pipeline}")
                    print(f"[calibrate] {pipeline} on 2 shaped hosts", flush=True)
                    figures = bench_embedding_comm.train_once(
                        2, pipeline, 85, run_dir, [f"--transport.kind={LINK_TRANSPORT}", f"--run.seed={CALIBRATION_SEED}",
                                                   "--train.ledger=true", f"--profile.warmup_steps={warmup}"], hosts)
                    fit = fit_rank_costs(run_dir, load_config(os.path.join(run_dir, "config.yaml")), 2, model, warmup)
                    out["calibration"][v] = {**fit, "collision_rate": figures["collision_rate"] or 0.0}
            if measured is not None:
                if gbit not in measured:
                    sys.exit(f"--link-measured: no run at {gbit:g} Gbit/s (has {sorted(measured)})")
                out["measured"][gbit] = measured[gbit]
                continue
            runs = {v: [] for v in LINK_PIPELINES}
            for rep in range(repeats):
                for v, pipeline in LINK_PIPELINES.items():
                    r = bench_embedding_comm.train_once(
                        2, pipeline, steps, os.path.join(work, f"ref-link-{gbit:g}-{pipeline}-{rep}"),
                        [f"--transport.kind={LINK_TRANSPORT}", f"--run.seed={rep}", f"--profile.warmup_steps={warmup}"],
                        hosts)
                    runs[v].append(r)
                    print(f"[reference] {gbit:g} Gbit/s rep {rep} {pipeline:<12} exposed comm {r['exposed_comm_ms']:6.1f} "
                          f"ms | step {r['step_ms']:6.1f} ms", flush=True)
            out["measured"][gbit] = {v: {m: bench_e2e._stats([x[m] for x in rs]) for m in LINK_METRICS}
                                     for v, rs in runs.items()}
    return out


def simulate_link(link: dict, cost_path: str, steps: int) -> list[dict]:
    """The simulator on 2 hosts of one rank and one core, with the link's and the calibration's
    parameters, against the measured figures; one row per rate, variant and metric."""
    model = load_cost_model(cost_path)
    rows = []
    for gbit, comm in link["comm"].items():
        base = ["sim.ranks_per_host=1", "sim.cores_per_host=1", "sim.overlap_cpu_us=0",
                f"transport.kind={LINK_TRANSPORT}", "train.pipeline=prioritized",
                f"sim.inter_latency_us={comm['latency_us']}", f"sim.inter_bandwidth_gbs={comm['bandwidth_gbs']}"]
        sampler = LengthSampler(load_config(LINK_CONFIG, base))
        for v in variants(load_config(LINK_CONFIG, base)):
            own = link["calibration"][v.name]
            cfg = load_config(LINK_CONFIG, [*base, f"sim.compute_scale={own['compute_scale']}",
                                            f"sim.step_overhead_ms={own['step_overhead_ms']}",
                                            f"sim.imbalance_share={own['imbalance_share']}",
                                            f"sim.compute_jitter={own['compute_jitter']}",
                                            f"sim.jitter_steps={json.dumps(own['jitter_steps'])}",
                                            f"sim.background_cpu_ms={own['background_cpu_ms']}",
                                            f"sim.collision_rate={own['collision_rate']}"])
            sim = simulate_steps(cfg, v, 2, model, sampler, seed=cfg.run.seed, steps=steps)
            for metric in LINK_METRICS:
                m = link["measured"][gbit][v.name][metric]
                rows.append(_compared({"experiment": "shaped link", "link_gbit": gbit, "ranks": 2, "variant": v.name,
                                       "metric": metric}, getattr(sim, metric), m))
    return rows


def _compared(row: dict, simulated: float, measured: dict) -> dict:
    err = abs(simulated - measured["mean"]) / measured["mean"]
    return {**row, "simulated": simulated, "measured": measured["mean"], "measured_min": measured["min"],
            "measured_max": measured["max"], "relative_error": err, "within": err <= WITHIN}



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("all", "ranks", "link"), default="all",
                        help="the rank-count experiments, the shaped-link experiment, or both (the link one needs root)")
    parser.add_argument("--measured", default="", help="a bench_e2e JSON to compare with (default: measure now)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--link-gbit", type=float, nargs="+", default=[2.0, 3.0], help="the shaped link's rates")
    parser.add_argument("--link-measured", default="",
                        help="a bench_embedding_comm.py --hosts 2 JSON to compare with (default: measure now)")
    parser.add_argument("--repeats", type=int, default=3, help="reference runs per experiment and rank count")
    parser.add_argument("--train-steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=400, help="simulated steps per layout")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "sim_validation.json"))
    args = parser.parse_args()
    ranks_on, link_on = args.only in ("all", "ranks"), args.only in ("all", "link")
    if link_on and not available()[0]:
        sys.exit(f"the shaped-link experiment: {available()[1]} (--only ranks runs the others)")
    t_start = time.perf_counter()
    machine, comm, link, rows = {}, {}, None, []
    with tempfile.TemporaryDirectory() as work:
        if ranks_on:
            cost_path = os.path.join(work, "cost_model.json")
            measure_cost_model(cost_path)
            machine = {e: {R: measure_rank_costs(e, R, cost_path, work) for R in args.ranks}
                       for e in bench_e2e.EXPERIMENTS}
            comm = {(R, kind): measure_comm(R, work, kind) for R in args.ranks for kind in ("torch_dist", "host_staged")}
            measured = (measured_rows(args.measured) if args.measured else
                        measure_reference(args.ranks, args.repeats, args.train_steps, args.warmup, work))
            rows += simulate_ranks(args, machine, comm, measured, cost_path)
        if link_on:
            link_cost = os.path.join(work, "cost_model_link.json")
            # A smaller table: the per-sample compute is the same, a dense gradient of 2M rows is not.
            run([sys.executable, "-m", "freescale", "calibrate", "--config", LINK_CONFIG, "--out", link_cost,
                 "--repeats", "3", "--data.synthetic.num_items=100000"])
            link = measure_link(args.link_gbit, link_cost, work, args.repeats, 30, 6,
                                link_measured_rows(args.link_measured) if args.link_measured else None)
            rows += simulate_link(link, link_cost, args.steps)
    all_pass = all(r["within"] for r in rows)

    print(f"\n{'experiment':>12} {'ranks':>5} {'variant':>9} {'metric':>16} {'simulated':>10} {'measured (range)':>24} "
          f"{'error':>7}")
    for r in rows:
        where = r.get("experiment", "") + (f" {r['link_gbit']:g}G" if "link_gbit" in r else "")
        print(f"{where:>12} {r['ranks']:>5} {r['variant']:>9} {r['metric']:>16} {r['simulated']:>10.2f} "
              f"{r['measured']:>8.2f} ({r['measured_min']:.2f}-{r['measured_max']:.2f}) {100 * r['relative_error']:>6.1f}% "
              f"{'ok' if r['within'] else 'OUTSIDE'}")
    print(f"\nall within {100 * WITHIN:.0f}%: {all_pass}")
    result = {"within": WITHIN, "all_within": all_pass, "rows": rows, "seconds": round(time.perf_counter() - t_start, 1)}
    if ranks_on:
        result.update({"machine": {e: {str(R): v for R, v in rs.items()} for e, rs in machine.items()},
                       "comm": {f"{kind} {R} ranks": v for (R, kind), v in comm.items()}, "cores_per_host": args.cores,
                       "measured_from": os.path.relpath(args.measured, REPO) if args.measured else
                       f"this job: {args.repeats} runs per experiment, {args.train_steps} steps, {args.warmup} warm-up"})
    if link is not None:
        result["link"] = {"config": os.path.relpath(LINK_CONFIG, REPO), "transport": LINK_TRANSPORT,
                          "comm": {f"{g:g} Gbit/s": v for g, v in link["comm"].items()},
                          "calibration": link["calibration"],
                          "measured_from": os.path.relpath(args.link_measured, REPO) if args.link_measured else
                          f"this job: {args.repeats} runs per pipeline and rate, 30 steps, 6 warm-up"}
    write_json_atomic(args.out, result)
    print(f"wrote {args.out}")


def simulate_ranks(args, machine: dict, comm: dict, measured: dict, cost_path: str) -> list[dict]:
    """The rank-count experiments: every layout, both variants, straggler % and exposed communication."""
    for e, by_ranks in machine.items():
        for R, v in by_ranks.items():
            print(f"machine {e} {R} rank(s): {json.dumps({k: x for k, x in v.items() if k != 'jitter_steps'})}",
                  flush=True)
    for (R, kind), v in comm.items():
        print(f"comm {kind} {R} ranks: {json.dumps(v)}", flush=True)
    model = load_cost_model(cost_path)
    rows = []
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
                rows.append(_compared({"experiment": "ranks", "ranks": R, "variant": v.name, "metric": metric},
                                      getattr(sim, metric), stats[v.name][metric]))
    return rows


if __name__ == "__main__":
    main()
