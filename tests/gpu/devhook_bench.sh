#!/usr/bin/env bash
# The device-hook GPU batch: correctness runs, the overrun run, the cost benchmark and the 60 s
# calibration run, each its own process, logs under $OUT. Runs on the GPU machine from the repo root.
# Needs .carry/ with the plugin .so and the devhook_gpu benchmark binary, both built on a machine with
# cargo and NVCC (see docs/benchmarks.md, "Device hook"):
#   source scripts/install-nvcc.sh && cargo build --release -p ncclscope-plugin --benches \
#     && cargo build --release -p ncclscope-plugin
#   mkdir -p .carry && cp target/release/libnccl_profiler_ncclscope.so .carry/ \
#     && cp target/release/deps/devhook_gpu-<hash> .carry/devhook_gpu \
#     && cp target/release/deps/devhook_drain-<hash> .carry/devhook_drain   # optional
set -uo pipefail
OUT="${OUT:-/tmp/devhook-gpu}"
mkdir -p "$OUT"
so="$PWD/.carry/libnccl_profiler_ncclscope.so"
bin="$PWD/.carry/devhook_gpu"
summary="$OUT/summary.txt"
: > "$summary"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1

run() {
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$bin" "$so" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: rc=$? ($((SECONDS - t0)) s)" >> "$summary"
}

if [ "${1:-all}" = "quick" ]; then
  # Re-runs after a fix: the cost benchmark and the runs that failed before.
  run bench 120 bench
  run verify_device_wrap 60 verify device 4096 20000
  run overrun_host 40 overrun host
  run verify_device_deep 90 verify device 16384 1000
  grep -h -E "PASS|FAIL|ratio|bench_ns|_lost:|_delivered:|_written:|panicked|error" "$OUT"/*.log >> "$summary"
  cat "$summary"
  exit 0
fi
run verify_host_deep 90 verify host 16384 1000
run bench 120 bench
run calibration 100 calibration 60
run verify_device_deep 90 verify device 16384 1000
run verify_host_wrap 60 verify host 4096 20000
run verify_device_wrap 60 verify device 4096 20000
run overrun_host 40 overrun host
run overrun_device 40 overrun device
# The drain's CPU benchmark, on this machine's CPUs too, when carried (its own binary).
if [ -x .carry/devhook_drain ]; then
  t0=$SECONDS
  timeout 90 .carry/devhook_drain "$so" > "$OUT/drain_cpu.log" 2>&1
  echo "drain_cpu: rc=$? ($((SECONDS - t0)) s)" >> "$summary"
  grep -h -E "_per_s|_lost|idle|accounted|written_total" "$OUT/drain_cpu.log" >> "$summary"
fi
grep -h -E "PASS|FAIL|ratio|bench_ns|calibration_|_lost:|_delivered:|_written:|panicked|error" "$OUT"/*.log >> "$summary"
cat "$summary"
