#!/usr/bin/env bash
# The host-side figures issue 16 asks for on the GPU machine's 16 CPUs (no GPU needed, no cargo there):
#   1. fakenccl-bench: NCCL 2.30's event tree and the Coll pair through this plugin, an older build
#      (baseline), NCCL Inspector, NCCL's example profiler and no plugin, 1/2/4/8 threads, then the tree
#      with KernelCh events on a proxy thread;
#   2. daemon_core real: the release daemon binary over prefilled segments (1/8/32/64 ranks, kernel
#      records in order and late, spool off and on), records per CPU-second;
#   3. daemon_core rss at 32 and 64 ranks, 500 k records/s, spool on: loss and CPU.
# Build here, then carry .carry/:
#   cargo build --release -p ncclscope -p ncclscope-plugin -p ncclscope-fakenccl -p ncclscope-fakenccl-libcuda
#   cargo bench -p ncclscope --bench daemon_core --no-run    # prints the bench binary's path
#   .carry/ncclscope, .carry/bench16/{fakenccl-bench, libfakenccl_cuda.so, libnccl_profiler_ncclscope.so,
#   libnccl_profiler_ncclscope-main-*.so (baseline), daemon_core}, the peers from
#   ../shared/reference/peers/ (libnccl-profiler-inspector.so, libnccl-profiler-example-O2.so); strip them.
#   bash tests/gpu/host_bench.sh          (output on stdout and in $OUT/host_bench.txt)
set -uo pipefail
bin="$(readlink -f "${BIN:-.carry}")"
b="$bin/bench16"
log="${OUT:-/tmp}/host_bench.txt"
baseline="$(ls "$b"/libnccl_profiler_ncclscope-main-*.so | head -n 1)"
peers=(ncclscope="$b/libnccl_profiler_ncclscope.so" baseline="$baseline"
  inspector="$b/libnccl-profiler-inspector.so" example="$b/libnccl-profiler-example-O2.so" empty)
{
  echo "== $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2); baseline $(basename "$baseline")"
  echo "== fakenccl-bench, 11 rounds"
  timeout -s KILL 150 "$b/fakenccl-bench" --rounds 11 --cuda-stub "$b/libfakenccl_cuda.so" "${peers[@]}"
  echo "== fakenccl-bench --proxy --modes tree, 7 rounds"
  timeout -s KILL 90 "$b/fakenccl-bench" --rounds 7 --proxy --modes tree --cuda-stub "$b/libfakenccl_cuda.so" \
    "${peers[@]}"
  echo "== daemon_core real"
  NCCLSCOPE_BENCH_DAEMON="$bin/ncclscope" timeout -s KILL 180 "$b/daemon_core" real
  for ranks in 32 64; do
    echo "== daemon_core rss, $ranks ranks, 500 k records/s, spool on"
    NCCLSCOPE_BENCH_DAEMON="$bin/ncclscope" NCCLSCOPE_BENCH_RSS="$ranks,500000,1" \
      timeout -s KILL 60 "$b/daemon_core" rss
  done
} 2>&1 | tee "$log"
