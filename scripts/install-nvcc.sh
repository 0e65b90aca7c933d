#!/usr/bin/env bash
# Installs the pinned nvcc 13.0 from PyPI into <repo>/.venv-cuda (once) and exports NVCC. Sourced by
# test.sh; plugin/build.rs then compiles and device-links the CUDA code (and fails if it does not build).
# Versions: ../shared/reference/toolchain.md (13.0.x matches driver 580; every CUDA wheel pinned).
set -euo pipefail
venv="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv-cuda"
nvcc="$venv/lib/python3*/site-packages/nvidia/cu13/bin/nvcc"
if ! ls $nvcc >/dev/null 2>&1; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
    nvidia-cuda-runtime==13.0.96
fi
NVCC="$(cd "$(dirname $(ls $nvcc))" && pwd)/nvcc"
export NVCC
echo "nvcc: $("$NVCC" --version | tail -n 2 | head -n 1)"
