#!/usr/bin/env bash
# Create .venv and install the pinned FreeScale stack into it.
#
# Idempotent: a venv whose stamp matches this script's pins is left as it is, so the README's
# commands can call this every time. On a machine with CUDA (nvidia-smi answers) the CUDA
# builds of torch and fbgemm-gpu are installed (torch from FREESCALE_TORCH_INDEX when set, e.g.
# https://download.pytorch.org/whl/cu128, else the package index's default Linux wheel, a CUDA
# build) and checked to see the GPU; elsewhere the CPU builds.
#
#   scripts/setup.sh          install (or keep) the venv
#   scripts/setup.sh --plan   print the build and the packages it would install, install nothing
#
# TorchRec is installed with --no-deps: its declared dependency on fbgemm-gpu would pull the
# CUDA wheel and overwrite the CPU build, which then fails to load.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${FREESCALE_VENV:-$root/.venv}"
python="${PYTHON:-python3}"

TORCH=torch==2.13.0
FBGEMM_VERSION=1.8.0
TORCHFT=torchft==0.2.0
TORCHREC=torchrec==1.8.0
TORCHREC_DEPS=(pyre-extensions tensordict "torchmetrics==1.0.3" tqdm)
# tensorboard: run.tensorboard's event files (and the tests that read them back); 2.21 accepts
# the protobuf 7 and numpy 2 the rest of the stack installs. pyarrow: the Parquet sample files
# (freescale.data.sample_files); duckdb: `freescale prepare`'s out-of-core engine.
TOOLS=(numpy pyyaml matplotlib pytest pytest-timeout pytest-xdist hypothesis "tensorboard==2.21.0" "pyarrow==26.0.1" "duckdb==2.0.1")
# torchx: the cluster launcher of the replica groups (freescale/torchx.py, docs/cluster.md).
# Installed with --no-deps like TorchRec: it pins urllib3<1.27 (for its docker scheduler, which
# needs the docker package too), and would downgrade the urllib3 2 the rest of the stack has;
# its local, SLURM and Kubernetes paths need only these.
TORCHX=torchx==0.7.0
TORCHX_DEPS=(docstring-parser importlib-metadata tabulate filelock fsspec pyre-extensions pyyaml)

TORCH_INDEX=()
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  BUILD=cuda
  FBGEMM="fbgemm-gpu==$FBGEMM_VERSION"
  if [ -n "${FREESCALE_TORCH_INDEX:-}" ]; then
    TORCH_INDEX=(--index-url "$FREESCALE_TORCH_INDEX")
  fi
else
  BUILD=cpu
  FBGEMM="fbgemm-gpu-cpu==$FBGEMM_VERSION"
fi

if [ "${1:-}" = "--plan" ]; then
  echo "build: $BUILD"
  echo "venv: $venv"
  echo "$TORCH ${TORCH_INDEX[*]}"
  echo "$FBGEMM $TORCHFT"
  echo "$TORCHREC (--no-deps) ${TORCHREC_DEPS[*]}"
  echo "$TORCHX (--no-deps) ${TORCHX_DEPS[*]}"
  echo "${TOOLS[*]}"
  exit 0
elif [ -n "${1:-}" ]; then
  echo "setup.sh: unknown argument ${1} (expected --plan or nothing)" >&2
  exit 2
fi

stamp_text="$BUILD $TORCH ${TORCH_INDEX[*]} $FBGEMM $TORCHFT $TORCHREC ${TORCHREC_DEPS[*]} ${TOOLS[*]} $TORCHX ${TORCHX_DEPS[*]} editable"
stamp="$venv/.freescale-stamp"
# FreeScale's own modules compiled ahead: where PYTHONDONTWRITEBYTECODE is set, no process
# writes their bytecode, and every rank, agent and CLI call would compile them anew.
precompile() { "$venv/bin/python" -m compileall -q "$root/freescale" >/dev/null; }
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$stamp_text" ] && "$venv/bin/python" -c "import freescale" 2>/dev/null; then
  precompile
  exit 0
fi

echo "[setup] creating $venv ($FBGEMM)" >&2
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" --upgrade pip setuptools wheel
echo "[setup] installing $TORCH ($BUILD build)" >&2
"${pip[@]}" "${TORCH_INDEX[@]}" "$TORCH"
if [ "$BUILD" = cuda ] && ! "$venv/bin/python" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)"; then
  echo "[setup] nvidia-smi sees a GPU but the installed $TORCH is a CPU build; set FREESCALE_TORCH_INDEX to a CUDA wheel index (e.g. https://download.pytorch.org/whl/cu128) and run again" >&2
  exit 1
fi
# Everything else in two resolves: the packages with their dependencies (torch pinned), then
# the ones installed without theirs (see above) and FreeScale itself.
echo "[setup] installing $FBGEMM $TORCHFT, TorchRec's and TorchX's dependencies and the tools" >&2
"${pip[@]}" "$FBGEMM" "$TORCHFT" "${TORCHREC_DEPS[@]}" "${TOOLS[@]}" "${TORCHX_DEPS[@]}" "$TORCH"
echo "[setup] installing $TORCHREC and $TORCHX (--no-deps) and freescale (editable)" >&2
"${pip[@]}" --no-deps "$TORCHREC" "$TORCHX" -e "$root"
"$venv/bin/python" -c "import torchrec, fbgemm_gpu, torchft, torch.utils.tensorboard, torchx.specs, torchx.schedulers.local_scheduler" >&2
if [ "$BUILD" = cuda ]; then
  "$venv/bin/python" -c "import torch, fbgemm_gpu; assert torch.cuda.is_available(), 'torch sees no GPU'; print('[setup] CUDA', torch.version.cuda, torch.cuda.get_device_name(0))" >&2
fi
precompile
echo "$stamp_text" > "$stamp"
echo "[setup] done" >&2
