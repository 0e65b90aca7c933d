#!/usr/bin/env bash
# GPU clock ground truth on the GPU machine (nvcc, PyTorch; no cargo, no network). About a minute.
#   bash tests/gpu/clock/run.sh [<libnccl_profiler_ncclscope.so> <segment-dump>]
# Compiles clock_probe.cu (nvcc -arch=sm_90), then clock_probe.py in one process: the flag-exchange
# bound on (CLOCK_REALTIME - %globaltimer) every second, CUPTI's kernel times against the kernel's own
# %globaltimer reads, and, given the plugin and segment-dump, the plugin's calibrations (through a
# one-rank PyTorch NCCL communicator) against the bound. Prints RESULT lines; files go to $OUT (or a
# temporary directory). DURATION (seconds, default 30) sets how long the bound is sampled.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-$(mktemp -d)}"
export OUT="$out"
mkdir -p "$out"
python="${PYTHON:-python3}"
nvcc="${NVCC:-$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null)}"
exec > >(tee "$out/clock_probe.log") 2>&1
date -u; nvidia-smi -L || true
"$nvcc" -O2 -arch=sm_90 -shared -Xcompiler -fPIC -o "$out/libclockprobe.so" "$here/clock_probe.cu" \
    || { echo "FAIL: nvcc"; exit 1; }
dumper=
if [ $# -eq 2 ]; then
    export NCCL_PROFILER_PLUGIN="$(readlink -f "$1")"
    export NCCLSCOPE_SOCKET="$out/segment-dump.sock" NCCLSCOPE_JOB_ID="clock-probe-$$"
    timeout 180 "$(readlink -f "$2")" "$NCCLSCOPE_SOCKET" > "$out/segment-dump.txt" &
    dumper=$!
fi
timeout 150 "$python" "$here/clock_probe.py" || { echo "FAIL: clock_probe.py"; exit 1; }
if [ -n "$dumper" ]; then
    wait "$dumper" || { echo "FAIL: segment-dump got no segment"; exit 1; }
    grep -E "Calibration" "$out/segment-dump.txt" | head -20
    "$python" "$here/clock_probe.py" --compare "$out/clock_probe.json" "$out/segment-dump.txt"
fi
echo "DONE (files in $out)"
