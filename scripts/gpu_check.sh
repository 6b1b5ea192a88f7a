#!/usr/bin/env bash
# The prepared GPU check: what FreeScale does on a CUDA GPU, in two tiers, with its log and
# figures under OUT_DIR.
#
#   scripts/gpu_check.sh [--tier torch|full] [--dry-run] [OUT_DIR]
#   scripts/gpu_check.sh --wheels
#
# --tier torch (the default) needs only a CUDA build of torch (>= 2.11) and the small
#   packages in scripts/requirements-gpu-torch.txt, on a plain checkout (PYTHONPATH is set to
#   it; nothing is installed). Steps:
#   1. tests      pytest tests/gpu/test_torch_*.py: Streams and the copy engine (each ordering
#                 call shown to matter), host_staged over CUDA tensors against gloo on 2 ranks
#                 sharing the GPU, the runner passing a copy that waits, the timeline's device
#                 spans, the dense model against the CPU with no host-device sync in its
#                 forward (the sync budget on real CUDA), the catch-up copy's stream order
#   2. copies     a GEMM loop's slowdown beside SM copies and beside copy-engine copies that
#                 outlast it (bench_transport.py --gpu-only) -> bench_transport_gpu.json
# --tier full needs scripts/setup.sh's stack (TorchRec, fbgemm-gpu, torchft). Steps:
#   1. tests      pytest -m gpu: every GPU test (the torch tier's, the owned tables on the
#                 device, calibration, the prioritized pipeline against sync on 2 ranks)
#   2. copies     as above
#   3. verify     freescale verify on the GPU: prioritized against sync, 2 ranks sharing the GPU
#                 over host_staged and gloo (NCCL refuses two ranks on one device), within
#                 VERIFY_TOLERANCE (default 1e-5; bitwise is reported when it holds)
#   4. bubbles    a short profiled prioritized run on the GPU and its bubble report, compute
#                 read from CUDA events -> bubble_report.json
# The torch tier is the default because it runs wherever a CUDA torch does (a borrowed
# machine's stock image, no network): a first run there checks the GPU path instead of failing
# at an install. Name --tier full once scripts/setup.sh has installed the rest.
#
# Then gpu_check.json: the tier, each step's status, time and figures. The exit status is 0
# only when every step passed; 2 when the tier's requirements are missing (named in one line).
# OUT_DIR defaults to $OUT when set, else runs/gpu_check. Each step has a time limit: they add
# up to 8 minutes for the full tier and 5 for the torch tier.
#
# --dry-run prints, for the tier named (both when none is), what runs and what it needs, and
# checks that every script, test and config named exists and that pytest collects the tier's
# tests (where pytest is installed); it runs on CPU.
# --wheels prints the torch tier's packages and the pip commands that download them for
# Python 3.12 on manylinux x86_64 and install them on a machine without network.
# GPU_CHECK_DEVICE=cpu rehearses a tier on CPU (the GPU tests are then skipped, the copy
# benchmark says it has no GPU): the script's own plumbing, checked where there is no GPU.
# Python: $PYTHON, else .venv/bin/python, else python3. FreeScale is taken from this checkout.
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
usage="expected --tier torch|full, --dry-run, --wheels, --help or OUT_DIR"
dry=0
wheels=0
tier=""
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --wheels) wheels=1 ;;
    --tier) [ $# -gt 1 ] || { echo "gpu_check.sh: --tier needs a value (torch or full)" >&2; exit 2; }
            tier="$2"; shift ;;
    --tier=*) tier="${1#--tier=}" ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $1 ($usage)" >&2; exit 2 ;;
    *) [ -z "$out" ] || { echo "gpu_check.sh: one OUT_DIR expected, got $out and $1" >&2; exit 2; }; out="$1" ;;
  esac
  shift
done
case "$tier" in
  ""|torch|full) ;;
  *) echo "gpu_check.sh: unknown tier $tier (expected torch or full)" >&2; exit 2 ;;
esac
out="${out:-${OUT:-runs/gpu_check}}"
if [ -n "${PYTHON:-}" ]; then py="$PYTHON"; elif [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
requirements=scripts/requirements-gpu-torch.txt

if [ "$wheels" = 1 ]; then
  echo "gpu_check: the torch tier needs a CUDA build of torch (>= 2.11) and ($requirements):"
  grep -v '^#' "$requirements" | sed '/^$/d; s/^/  /'
  echo "On a machine with network, download them for Python 3.12 on manylinux x86_64 (another Python:"
  echo "change --python-version and --abi):"
  echo "  pip download --dest gpu_wheels --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \\"
  echo "    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \\"
  echo "    -r $requirements"
  echo "Bring gpu_wheels/ and this checkout to the GPU machine, then (what is installed already is kept):"
  echo "  python3 -m pip install --no-index --find-links gpu_wheels -r $requirements"
  echo "  scripts/gpu_check.sh --tier torch"
  exit 0
fi

tolerance="${VERIFY_TOLERANCE:-1e-5}"
# Run folders go to a temporary folder; what comes back is under $out.
if [ "$dry" = 1 ]; then work='<temporary folder>'; else work="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"; fi
config=configs/quickstart.yaml
small=(--data.batch_size=64 --data.max_uih_len=256 --data.eval_samples=256 --train.eval_every=0 --checkpoint.every=0)
device="${GPU_CHECK_DEVICE:-cuda}"
on_gpu=(--run.device="$device" --train.backend=gloo --transport.kind=host_staged)
torchrun=("$py" -m torch.distributed.run --standalone --nproc-per-node 2)
torch_tests=(tests/gpu/test_torch_*.py)
copies="copies|60|$py scripts/bench_transport.py --gpu-only --out $out/bench_transport_gpu.json"

# Per tier: its steps (name | time limit in s | command), what it needs, the files it names,
# the Python modules it imports beyond torch, and how pytest collects its tests.
torch_steps=(
  "tests|240|$py -m pytest -q -rs -p no:cacheprovider ${torch_tests[*]}"
  "$copies"
)
torch_needs="Python >= 3.10, a CUDA build of torch >= 2.11, and $requirements (numpy, pyyaml, pytest, pytest-timeout); no TorchRec, fbgemm-gpu or torchft"
torch_files=("${torch_tests[@]}" tests/gpu/test_torch_streams.py tests/gpu/test_torch_copy_engine.py
             tests/gpu/test_torch_transport.py tests/gpu/test_torch_timeline.py tests/gpu/test_torch_dense.py
             tests/helpers/syncs.py tests/conftest.py
             tests/helpers/spawn.py tests/helpers/cuda.py scripts/bench_transport.py
             freescale/transport/sm_contention.py "$requirements")
torch_modules="numpy yaml pytest"
torch_collect=("${torch_tests[@]}")
full_steps=(
  "tests|200|$py -m pytest -m gpu -q -rs -p no:cacheprovider tests"
  "$copies"
  "verify|100|${torchrun[*]} -m freescale verify --config $config --steps 20 --tolerance $tolerance ${on_gpu[*]} ${small[*]}"
  "bubbles|120|${torchrun[*]} -m freescale train --config $config --train.pipeline=prioritized --train.steps=60 --profile.enable=true --run.dir=$work/bubbles ${on_gpu[*]} ${small[*]} && $py -m freescale report $work/bubbles --out $work/report && cp $work/report/report.json $out/bubble_report.json"
)
full_needs="scripts/setup.sh's stack: torch with CUDA, fbgemm-gpu, torchrec and torchft (and what the torch tier needs)"
full_files=(scripts/bench_transport.py tests/gpu/test_cuda.py tests/dist/test_prioritized.py tests/conftest.py
            "$config" freescale/__main__.py freescale/train/verify.py freescale/profile/report.py scripts/setup.sh)
full_modules="numpy yaml pytest fbgemm_gpu torchrec torchft"
full_collect=(-m gpu tests)

if [ "$dry" = 1 ]; then
  missing=0
  echo "gpu_check: would write under $out (python: $py)"
  for t in ${tier:-torch full}; do
    declare -n steps="${t}_steps" files="${t}_files" collect="${t}_collect"
    needs="${t}_needs"
    echo "tier $t: needs ${!needs}"
    for step in "${steps[@]}"; do
      IFS='|' read -r name limit cmd <<< "$step"
      echo "  [$name, at most ${limit}s] $cmd"
    done
    for f in "${files[@]}"; do
      [ -e "$f" ] || { echo "gpu_check: tier $t: missing $f" >&2; missing=1; }
    done
    if "$py" -c "import pytest" 2>/dev/null; then
      collected=$("$py" -m pytest --collect-only -q -p no:cacheprovider "${collect[@]}" 2>/dev/null | grep -c '::')
      echo "gpu_check: tier $t: pytest collects $collected test(s)"
      [ "$collected" -gt 0 ] || { echo "gpu_check: tier $t: pytest collects no test" >&2; missing=1; }
    fi
    unset -n steps files collect
  done
  [ "$missing" = 0 ] && echo "gpu_check: dry run ok"
  exit "$missing"
fi

tier="${tier:-torch}"
declare -n steps="${tier}_steps"
modules="${tier}_modules"
mkdir -p "$out"
trap 'rm -rf "$work"' EXIT
log="$out/gpu_check.log"
results="$work/steps.tsv"
: > "$results"
exec > >(tee -a "$log") 2>&1
echo "gpu_check: tier $tier, $(date -u +%FT%TZ) on $(hostname), python $py"
command -v "$py" >/dev/null || { echo "gpu_check: python $py not found (set PYTHON)" >&2; exit 2; }
# What the tier needs, before any step: one line naming what is missing.
"$py" - "$tier" "$device" "${!modules}" <<'EOF' || exit 2
import importlib, sys
tier, device, modules = sys.argv[1], sys.argv[2], sys.argv[3].split()
problems = []
try:
    import torch
except Exception as e:
    sys.exit(f"gpu_check: torch cannot be imported ({str(e).splitlines()[0]}): the {tier} tier needs a CUDA build of torch >= 2.11")
major, minor = (int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
if (major, minor) < (2, 11):
    problems.append(f"torch {torch.__version__} is older than 2.11")
if device == "cuda" and not torch.cuda.is_available():
    problems.append(f"torch {torch.__version__} sees no CUDA device" + ("" if torch.version.cuda else " (a CPU build)"))
missing = []
for name in modules:
    try:
        importlib.import_module(name)
    except Exception:
        missing.append(name)
if missing:
    hint = ("scripts/setup.sh installs them, or run --tier torch" if tier == "full"
            else "scripts/gpu_check.sh --wheels says how to bring them")
    problems.append(f"missing {', '.join(missing)} ({hint})")
if problems:
    sys.exit(f"gpu_check: the {tier} tier cannot run here: " + "; ".join(problems))
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() and device == "cuda" else "no GPU (a rehearsal on CPU)"
print(f"gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, python {sys.version.split()[0]}, {gpu}")
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

"$py" - "$out" "$results" "$log" "$tolerance" "$tier" <<'EOF'
import json, os, re, sys
out, results, log, tolerance, tier = sys.argv[1:6]
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
    steps["copies"]["copies_outlasted_the_gemms"] = gpu["covered"]
if "verify" in steps:
    steps["verify"]["tolerance"] = float(tolerance)
    steps["verify"]["bitwise"] = "bitwise identical" in text and "NOT bitwise identical" not in text
    steps["verify"]["max_diffs"] = {k: float(v) for k, v in re.findall(r"^(\w[\w ]+):\s+max \|diff\| (\S+)", text, re.M)}
report = load("bubble_report.json")
if report and "bubbles" in steps:
    keys = ("compute_from", "bubble_fraction", "step_ms", "compute_ms_per_step", "exposed_comm_ms_per_step",
            "straggler_pct", "collision_rate")
    steps["bubbles"]["summary"] = {k: report["summary"].get(k) for k in keys}
summary = {"tier": tier, "passed": all(s["status"] == "passed" for s in steps.values()), "steps": steps}
tmp = os.path.join(out, ".gpu_check.json.tmp")
with open(tmp, "w") as f:
    json.dump(summary, f, indent=2)
os.replace(tmp, os.path.join(out, "gpu_check.json"))
print(json.dumps(summary, indent=2))
EOF
echo "gpu_check: wrote $log and $out/gpu_check.json"
exit "$failed"
