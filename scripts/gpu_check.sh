#!/usr/bin/env bash
# The prepared GPU check: everything FreeScale does on a CUDA GPU, in one run of under 8 minutes
# on one GPU, with its log and figures under OUT_DIR.
#
#   scripts/gpu_check.sh [--dry-run] [OUT_DIR]
#
# OUT_DIR defaults to $OUT when set, else runs/gpu_check. Steps (each with a time limit):
#   1. tests      pytest -m gpu: copy engine without a kernel, side-stream ordering, the owned
#                 tables on the device, host_staged over device tensors, CUDA-event timing,
#                 calibration on the GPU, the prioritized pipeline against sync on 2 ranks
#   2. copies     a GEMM's slowdown beside an SM copy kernel and beside a copy-engine copy
#                 (bench_transport.py --gpu-only, 3 alternating repeats) -> bench_transport_gpu.json
#   3. verify     freescale verify on the GPU: prioritized against sync, 2 ranks sharing the GPU
#                 over host_staged and gloo (NCCL refuses two ranks on one device), within
#                 VERIFY_TOLERANCE (default 1e-5; bitwise is reported when it holds)
#   4. bubbles    a short profiled prioritized run on the GPU and its bubble report, compute
#                 read from CUDA events -> bubble_report.json
# Then gpu_check.json: each step's status, time and figures. The exit status is 0 only when
# every step passed.
#
# --dry-run prints the steps' commands and checks that every script, test and config they name
# exists (and that pytest collects the gpu tests, where pytest is installed); it runs on CPU.
#
# GPU_CHECK_DEVICE=cpu rehearses the same steps on CPU (the gpu tests are then skipped, the
# copy benchmark says it has no GPU): the script's own plumbing, checked where there is no GPU.
#
# Python: $PYTHON, else .venv/bin/python, else python3 (it needs torch with CUDA, fbgemm-gpu,
# torchrec and torchft; scripts/setup.sh installs them). FreeScale is taken from this checkout.
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
dry=0
out=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry=1 ;;
    -h|--help) sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $arg (expected --dry-run, --help or OUT_DIR)" >&2; exit 2 ;;
    *) [ -z "$out" ] || { echo "gpu_check.sh: one OUT_DIR expected, got $out and $arg" >&2; exit 2; }; out="$arg" ;;
  esac
done
out="${out:-${OUT:-runs/gpu_check}}"
if [ -n "${PYTHON:-}" ]; then py="$PYTHON"; elif [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
tolerance="${VERIFY_TOLERANCE:-1e-5}"
# Run folders go to a temporary folder; what comes back is under $out.
if [ "$dry" = 1 ]; then work='<temporary folder>'; else work="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"; fi
config=configs/quickstart.yaml
small=(--data.batch_size=64 --data.max_uih_len=256 --data.eval_samples=256 --train.eval_every=0 --checkpoint.every=0)
device="${GPU_CHECK_DEVICE:-cuda}"
on_gpu=(--run.device="$device" --train.backend=gloo --transport.kind=host_staged)
torchrun=("$py" -m torch.distributed.run --standalone --nproc-per-node 2)

# name | time limit (s) | command
steps=(
  "tests|200|$py -m pytest -m gpu -q -rs -p no:cacheprovider tests"
  "copies|60|$py scripts/bench_transport.py --gpu-only --out $out/bench_transport_gpu.json"
  "verify|100|${torchrun[*]} -m freescale verify --config $config --steps 20 --tolerance $tolerance ${on_gpu[*]} ${small[*]}"
  "bubbles|120|${torchrun[*]} -m freescale train --config $config --train.pipeline=prioritized --train.steps=60 --profile.enable=true --run.dir=$work/bubbles ${on_gpu[*]} ${small[*]} && $py -m freescale report $work/bubbles --out $work/report && cp $work/report/report.json $out/bubble_report.json"
)
needed=(scripts/bench_transport.py tests/gpu/test_cuda.py tests/dist/test_prioritized.py tests/conftest.py
        "$config" freescale/__main__.py freescale/train/verify.py freescale/profile/report.py)

if [ "$dry" = 1 ]; then
  echo "gpu_check: would write under $out (python: $py)"
  for step in "${steps[@]}"; do
    IFS='|' read -r name limit cmd <<< "$step"
    echo "  [$name, at most ${limit}s] $cmd"
  done
  missing=0
  for f in "${needed[@]}"; do
    [ -e "$f" ] || { echo "gpu_check: missing $f" >&2; missing=1; }
  done
  if "$py" -c "import pytest" 2>/dev/null; then
    collected=$("$py" -m pytest -m gpu --collect-only -q -p no:cacheprovider tests 2>/dev/null | grep -c '::')
    echo "gpu_check: pytest -m gpu collects $collected test(s)"
    [ "$collected" -gt 0 ] || { echo "gpu_check: pytest -m gpu collects no test" >&2; missing=1; }
  fi
  [ "$missing" = 0 ] && echo "gpu_check: dry run ok"
  exit "$missing"
fi

mkdir -p "$out"
trap 'rm -rf "$work"' EXIT
log="$out/gpu_check.log"
results="$work/steps.tsv"
: > "$results"
exec > >(tee -a "$log") 2>&1
echo "gpu_check: $(date -u +%FT%TZ) on $(hostname), python $py"
if [ "$device" = cuda ] && ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: torch sees no CUDA device here ($("$py" -c 'import torch; print(torch.__version__)' 2>&1)); nothing to check" >&2
  exit 2
fi
"$py" - <<'EOF'
import importlib, torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU (a rehearsal on CPU)"
print(f"gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, {gpu}")
for name in ("fbgemm_gpu", "torchrec", "torchft"):
    try:
        module = importlib.import_module(name)
        print(f"gpu_check: {name} {getattr(module, '__version__', '?')}")
    except Exception as e:
        print(f"gpu_check: {name} missing ({str(e).splitlines()[0]}): the steps that need it fail")
EOF

failed=0
for step in "${steps[@]}"; do
  IFS='|' read -r name limit cmd <<< "$step"
  echo
  echo "=== $name (at most ${limit}s): $cmd"
  start=$(date +%s%N)
  timeout --kill-after=10 "$limit" bash -c "$cmd"
  rc=$?
  seconds=$(( ($(date +%s%N) - start) / 1000000 ))
  status=passed
  [ "$rc" = 0 ] || { status=failed; failed=1; }
  [ "$rc" = 124 ] && status="timed out"
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$seconds" >> "$results"
  echo "=== $name: $status (exit $rc, ${seconds} ms)"
done

"$py" - "$out" "$results" "$log" "$tolerance" <<'EOF'
import json, os, re, sys
out, results, log, tolerance = sys.argv[1:5]
text = open(log, errors="replace").read()
steps = {}
for line in open(results):
    name, status, rc, seconds = line.rstrip("\n").split("\t")
    steps[name] = {"status": status, "exit": int(rc), "seconds": round(int(seconds) / 1000, 1)}
tests = re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped|errors?|deselected)[\w, ]*) in [\d.]+s", text, re.M)
steps.get("tests", {})["summary"] = tests[-1] if tests else None
def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None
gpu = (load("bench_transport_gpu.json") or {}).get("gpu")
if gpu and "copies" in steps:
    steps["copies"]["gemm_slowdown_pct"] = {k: gpu[f"{k}_slowdown_pct"] for k in ("sm_copy", "copy_engine")}
if "verify" in steps:
    steps["verify"]["tolerance"] = float(tolerance)
    steps["verify"]["bitwise"] = "bitwise identical" in text and "NOT bitwise identical" not in text
    steps["verify"]["max_diffs"] = {k: float(v) for k, v in re.findall(r"^(\w[\w ]+):\s+max \|diff\| (\S+)", text, re.M)}
report = load("bubble_report.json")
if report and "bubbles" in steps:
    keys = ("compute_from", "bubble_fraction", "step_ms", "compute_ms_per_step", "exposed_comm_ms_per_step",
            "straggler_pct", "collision_rate")
    steps["bubbles"]["summary"] = {k: report["summary"].get(k) for k in keys}
summary = {"passed": all(s["status"] == "passed" for s in steps.values()), "steps": steps}
tmp = os.path.join(out, ".gpu_check.json.tmp")
with open(tmp, "w") as f:
    json.dump(summary, f, indent=2)
os.replace(tmp, os.path.join(out, "gpu_check.json"))
print(json.dumps(summary, indent=2))
EOF
echo "gpu_check: wrote $log and $out/gpu_check.json"
exit "$failed"
