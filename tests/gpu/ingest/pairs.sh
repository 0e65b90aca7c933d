#!/usr/bin/env bash
# Ingest throughput of two builds side by side (docs/benchmarks.md): alternated pairs of the
# in-process `ingest` bench, the order swapped every other pair, pinned to one core, plus each
# build's user-space instructions per run where the host can count them (deterministic,
# unlike CPU time on a shared host). Runs without cargo (the bench executables are carried).
#   bash tests/gpu/ingest/pairs.sh BEFORE AFTER [PAIRS] [RANKS,SPOOL]
# Prints one line per run: "<build> <M records per CPU-second of the engine thread>", then the
# instruction counts (the whole process: the bench's own set-up, the same code in both, included).
set -euo pipefail
before=$1 after=$2 pairs=${3:-12} case=${4:-8,0}
core=${CORE:-5}
run() { NCCLSCOPE_BENCH_INGEST=$case taskset -c "$core" "$1" ingest --bench 2>&1; }
for i in $(seq 1 "$pairs"); do
  if (( i % 2 )); then order="before after"; else order="after before"; fi
  for b in $order; do
    exe=$before; [[ $b == after ]] && exe=$after
    echo "$b $(run "$exe" | sed -nE 's/.*: ([0-9.]+) M records per CPU-second of the engine thread.*/\1/p')"
  done
done
# perf where it counts; else instructions.py (perf_event_open from Python, for hosts without perf).
here=$(dirname "$0")
count() {
  if command -v perf >/dev/null && perf stat -e instructions:u true >/dev/null 2>&1; then
    NCCLSCOPE_BENCH_INGEST=$case perf stat -x, -e instructions:u taskset -c "$core" "$1" ingest --bench 2>&1 >/dev/null | grep instructions | cut -d, -f1
  else
    NCCLSCOPE_BENCH_INGEST=$case python3 "$here/instructions.py" taskset -c "$core" "$1" ingest --bench 2>/dev/null
  fi
}
for b in before after before after; do
  exe=$before; [[ $b == after ]] && exe=$after
  echo "instructions $b $(count "$exe" || echo "not counted on this host")"
done
