#!/usr/bin/env bash
# GPU machine check (no cargo there): PyTorch's NCCL loads the prebuilt plugin through
# NCCL_PROFILER_PLUGIN, a one-rank communicator runs all-reduces, and segment-dump (listening in the
# daemon's place) prints what the plugin wrote into the segment it handed over. Passes when NCCL logged the plugin as loaded and the segment holds the
# communicator's registration (Comm record: commHash, rank 0, nranks 1).
#   bash tests/gpu/torch_nccl_one_rank.sh <path-to-libnccl_profiler_ncclscope.so> <path-to-segment-dump>
# Writes its log to $OUT (if set) or a temporary directory. PYTHON selects the interpreter (default python3).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
[ $# -eq 2 ] || { echo "usage: $0 <plugin.so> <segment-dump>" >&2; exit 2; }
so="$(readlink -f "$1")"
dump="$(readlink -f "$2")"
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"
log="$out/torch_nccl_one_rank.log"
python="${PYTHON:-python3}"
exec > >(tee "$log") 2>&1

fail() { echo "FAIL: $*"; exit 1; }

echo "== machine"
date -u; uname -a; nvidia-smi -L || true
ldd --version | head -1
echo "== plugin $so"
ls -l "$so" "$dump" || fail "missing input"
# Every symbol must resolve (NCCL dlopens with RTLD_NOW): ldd -r reports unresolved symbols and glibc versions.
ldd -r "$so" 2>&1 | tee "$out/ldd.txt"
grep -Eq "not found|undefined symbol" "$out/ldd.txt" && fail "the plugin does not resolve on this machine (see ldd above)"
grep -Eq "libcuda|libnccl" "$out/ldd.txt" && fail "the plugin links CUDA or NCCL"

echo "== run"
export NCCL_PROFILER_PLUGIN="$so"
export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,ENV,PROFILE
export NCCLSCOPE_SOCKET="$out/segment-dump.sock"
export NCCLSCOPE_JOB_ID="gpu-check-$$"
timeout 300 "$dump" "$NCCLSCOPE_SOCKET" > "$out/segment-dump.txt" &
dumper=$!
"$python" "$here/torch_nccl_one_rank.py"
rc=$?
[ $rc -eq 0 ] || fail "the PyTorch job failed (exit $rc)"

echo "== checks"
grep -E "NCCLSCOPE: plugin .* loaded as ncclProfiler_v[0-9]" "$log" || fail "NCCL did not log the plugin as loaded"
grep -E "PROFILER|[Pp]rofiler" "$log" | grep -v NCCLSCOPE | head -20

echo "== segment"
wait "$dumper" || fail "no segment was handed over"
cat "$out/segment-dump.txt"
grep -Eq "Comm \{ comm: [0-9]+, comm_hash: [0-9]+, rank: 0, nranks: 1," "$out/segment-dump.txt" \
    || fail "no Comm record with rank 0 / nranks 1"
grep -q "CommEnd" "$out/segment-dump.txt" || echo "note: no CommEnd (finalize not reached before exit)"
echo "records: $(grep -cE '^  [0-9]+: ' "$out/segment-dump.txt")"
echo "PASS (log: $log)"
