"""Cost of bubble profiling: the recorder alone, and training with profiling off and on.

    .venv/bin/python scripts/bench_profiler.py [--steps 150] [--out runs/bench_profiler.json]

(1) Recorder micro-benchmark: one step's worth of recording (begin, a data span, the phase
    spans, end with its JSON line) in a loop, microseconds per step.
(2) End to end: the quickstart on 2 ranks with ``profile.enable`` false, then true, in the
    same invocation; mean ms/step after warm-up from each run's metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from freescale.io import write_json_atomic  # noqa: E402
from freescale.progress import bar  # noqa: E402
from freescale.profile.timeline import StepTimeline  # noqa: E402


class _Out:
    def __init__(self):
        import torch

        self.sample_ids = torch.arange(64)
        self.uih_lengths = torch.full((64,), 32)


def recorder_us_per_step(steps: int = 20000) -> float:
    out = _Out()
    with tempfile.TemporaryDirectory() as tmp:
        tl = StepTimeline(os.path.join(tmp, "profile", "rank0.jsonl"), rank=0, world_size=1, clock_offset=0.0, threads=1)
        batches = tl.timed_batches(iter(range(steps + 1)))
        t0 = time.perf_counter()
        for step in range(1, steps + 1):
            tl.begin_step(step)
            next(batches)
            for kind in ("input_dist", "forward", "backward", "optimizer"):
                tl.open(kind)
                tl.close(kind)
            tl.end_step(step, out)
        elapsed = time.perf_counter() - t0
        tl.finish()
    return 1e6 * elapsed / steps


def train_ms_per_step(enable: bool, steps: int, run_dir: str) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "freescale", "train",
           "--config", os.path.join(REPO, "configs", "quickstart.yaml"), f"--run.dir={run_dir}", f"--train.steps={steps}",
           "--train.eval_every=0", "--checkpoint.at_end=false", "--checkpoint.every=0", "--data.eval_samples=256",
           "--run.log_every=25", f"--profile.enable={'true' if enable else 'false'}"]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True)
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if "time/step(ms)" in line]
    kept = records[1:]  # the first window holds start-up
    return sum(r["time/step(ms)"] for r in kept) / len(kept)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150, help="training steps per end-to-end run")
    parser.add_argument("--repeats", type=int, default=2, help="off/on pairs")
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "bench_profiler.json"))
    args = parser.parse_args()

    micro = recorder_us_per_step()
    print(f"recorder alone: {micro:.1f} us per step")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in bar(range(args.repeats), desc="bench_profiler", unit="pair"):
            off = train_ms_per_step(False, args.steps, os.path.join(tmp, f"off{i}"))
            on = train_ms_per_step(True, args.steps, os.path.join(tmp, f"on{i}"))
            rows.append({"repeat": i, "off_ms_per_step": round(off, 3), "on_ms_per_step": round(on, 3),
                         "ratio_on_over_off": round(on / off, 4)})
            print(f"repeat {i}: profiling off {off:.2f} ms/step | on {on:.2f} ms/step | on/off {on / off:.3f}")
    off = sum(r["off_ms_per_step"] for r in rows) / len(rows)
    on = sum(r["on_ms_per_step"] for r in rows) / len(rows)
    print("\n| profiling | ms/step (2 ranks, quickstart) |\n|---|---|")
    print(f"| off | {off:.2f} |\n| on | {on:.2f} |\n| on / off | {on / off:.3f} |")
    result = {"recorder_us_per_step": round(micro, 2), "runs": rows, "off_ms_per_step": round(off, 3),
              "on_ms_per_step": round(on, 3), "ratio_on_over_off": round(on / off, 4), "steps": args.steps}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_json_atomic(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
