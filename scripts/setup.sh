#!/usr/bin/env bash
# Create .venv and install the pinned FreeScale stack into it.
#
# Idempotent: a venv whose stamp matches this script's pins is left as it is, so the README's
# commands can call this every time. On a machine with CUDA (nvidia-smi answers) the CUDA
# build of fbgemm-gpu is installed; elsewhere the CPU build.
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
# the protobuf 7 and numpy 2 the rest of the stack installs.
TOOLS=(numpy pyyaml matplotlib pytest pytest-timeout hypothesis "tensorboard==2.21.0")

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  FBGEMM="fbgemm-gpu==$FBGEMM_VERSION"
else
  FBGEMM="fbgemm-gpu-cpu==$FBGEMM_VERSION"
fi

stamp_text="$TORCH $FBGEMM $TORCHFT $TORCHREC ${TORCHREC_DEPS[*]} ${TOOLS[*]} editable"
stamp="$venv/.freescale-stamp"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$stamp_text" ] && "$venv/bin/python" -c "import freescale" 2>/dev/null; then
  exit 0
fi

echo "[setup] creating $venv ($FBGEMM)" >&2
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" --upgrade pip setuptools wheel
echo "[setup] installing $TORCH" >&2
"${pip[@]}" "$TORCH"
echo "[setup] installing $FBGEMM $TORCHFT" >&2
"${pip[@]}" "$FBGEMM" "$TORCHFT"
echo "[setup] installing $TORCHREC and its dependencies" >&2
"${pip[@]}" --no-deps "$TORCHREC"
"${pip[@]}" "${TORCHREC_DEPS[@]}" "$TORCH"
echo "[setup] installing tools and freescale (editable)" >&2
"${pip[@]}" "${TOOLS[@]}" "$TORCH"
"${pip[@]}" --no-deps -e "$root"
"$venv/bin/python" -c "import torchrec, fbgemm_gpu, torchft, torch.utils.tensorboard" >&2
echo "$stamp_text" > "$stamp"
echo "[setup] done" >&2
