#!/usr/bin/env bash
# Real NCCL 2.30.7 with the device-hook RFC (../shared/reference/rfc-nccl/), 2 ranks on the one GPU, through
# the release plugin, the daemon and a real OTLP/gRPC receiver, checked instance by instance (check.py):
#   eager      ROUNDS x (all-reduce, all-gather, reduce-scatter), 8 B .. 16 MiB
#   graph6     a graph of 50 mixed collectives, 6 replays, a synchronize and 4 eager collectives after each
#   burstN     the same graph replayed N times back to back (the CPU far ahead of the GPU)
#   torch      PyTorch, 2 processes: torch.cuda.graph of 30 collectives, 20 replays (torch_graphs.py)
#   torchraw   the same without the daemon: segment-dump saves both processes' segments (raw/*.seg.xz,
#              test data for the CPU tests, see tests/data/README.md) and prints their records
#   a2a, pp    PyTorch, 2 processes: MoE all_to_all_single and a pipeline-parallel batch_isend_irecv
#              schedule beside collectives, eager and in a CUDA graph (torch_p2p.py)
#   raw-a2a, raw-pp   the same without the daemon, saved as torchraw is
#   profile, profile0 PyTorch's profiler around 5 steps of an FSDP-style loop (torch_profile.py), each
#              rank's trace merged with `ncclscope export --merge`: every NCCL kernel must contain its
#              collective's slice (issue 38). profile warms up 7 s first (past the plugin's periodic
#              calibrations), profile0 profiles from the first step (only the first calibrations)
#   cost       a graph of 200 all-reduces at 8 B, 1 MiB and 16 MiB: no plugin, device ring (default),
#              host-mapped ring, NCCL's own KernelCh path; 3 processes each, interleaved; medians
# For the GPU machine, which has no cargo. Build here and carry .carry/ holding
#   ncclscope libnccl_profiler_ncclscope.so otlp-sink segment-dump libnccl.so.2.xz
#   (source scripts/install-nvcc.sh; cargo build --release -p ncclscope-plugin -p ncclscope \
#    -p ncclscope-tests -p ncclscope-fakenccl --bins; cp the four + ../shared/reference/rfc-nccl/libnccl.so.2.xz)
#   bash tests/gpu/rfc_nccl/run.sh [CASES...]     (default: all of the above)
# Needs nvcc and PyTorch's nvidia-nccl-cu13 wheel (for nccl.h) there. Results under WORK (default a temporary directory), packed into $OUT/rfc-nccl.tar.gz at the end.
# Every process runs under a hard time limit: a hang costs its limit, never the session.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="$(readlink -f "${BIN:-.carry}")"
work="${WORK:-$(mktemp -d)}"
out="$work/results"
mkdir -p "$out"
cases=("$@")
[ ${#cases[@]} -gt 0 ] || cases=(eager graph6 burst100 burst300 cost torch torchraw a2a pp raw-a2a raw-pp)
log() { echo "$(date +%T) $*" | tee -a "$out/steps.txt"; }
limited() { local s=$1; shift; timeout -s KILL "$s" "$@"; }  # limited SECONDS COMMAND...

# NCCL with the RFC, and the driver compiled against its header.
mkdir -p "$work/nccl"
xz -dc "$bin/libnccl.so.2.xz" > "$work/nccl/libnccl.so.2" && ln -sf libnccl.so.2 "$work/nccl/libnccl.so"
inc="$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "include"))')"
log "compiling the driver against $inc"
limited 120 nvcc -O2 -std=c++17 -arch=sm_90 -I"$inc" "$here/driver.cu" -L"$work/nccl" -lnccl \
  -Xlinker -rpath="$work/nccl" -o "$work/driver" > "$out/nvcc.log" 2>&1 || { log "driver did not build"; exit 1; }
export LD_LIBRARY_PATH="$work/nccl${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
log "sanity: driver without the plugin"
NCCL_DEBUG=INFO limited 30 "$work/driver" eager 10 > "$out/sanity.txt" 2>&1 < /dev/null
rc=$?
log "sanity rc=$rc $(tail -n 1 "$out/sanity.txt")"
[ $rc = 0 ] || { log "the driver fails without the plugin: only the torch case runs"; cases=(torch); }

export NCCLSCOPE_SOCKET="$work/ncclscope.sock"
plugin="$bin/libnccl_profiler_ncclscope.so"
"$bin/otlp-sink" --seconds 3000 > "$out/spans.jsonl" 2> "$work/sink.err" < /dev/null &
sink=$!
for _ in $(seq 50); do [ -s "$out/spans.jsonl" ] && break; sleep 0.1; done
endpoint="$(head -n 1 "$out/spans.jsonl" | cut -d' ' -f2)"
metrics_port=29611
# Per-job series on /metrics too (a test machine: no other user to hide them from), so check.py sees
# the families Grafana reads, Send and Recv included.
NCCLSCOPE_PROMETHEUS_JOB_SERIES=true "$bin/ncclscope" daemon --socket "$NCCLSCOPE_SOCKET" --api-socket "$work/api.sock" \
  --state-dir "$work/state" --spool-dir "$work/spool" --otlp-endpoint "$endpoint" \
  --prometheus-listen "127.0.0.1:$metrics_port" > /dev/null 2> "$out/daemon.log" < /dev/null &
daemon=$!
finish() {
  kill "$daemon" "$sink" 2>/dev/null
  [ -n "${OUT:-}" ] && tar czf "$OUT/rfc-nccl.tar.gz" -C "$work" results
}
trap finish EXIT
for _ in $(seq 100); do [ -S "$work/api.sock" ] && break; sleep 0.1; done
metrics() { curl -s -m 2 "127.0.0.1:$metrics_port/metrics"; }

# Until the daemon has delivered everything: received spans and the daemon's counters unchanged for 3 s.
settle() {
  local last="" now same=0
  for _ in $(seq 60); do
    sleep 1
    now="$(wc -l < "$out/spans.jsonl") $(metrics | grep -E '^ncclscope_(collectives|lost)_total' | md5sum)"
    if [ "$now" = "$last" ]; then same=$((same + 1)); [ $same -ge 3 ] && return; else same=0; fi
    last="$now"
  done
}

traced() {  # traced NAME SECONDS COMMAND...: one job through the daemon
  local name=$1 s=$2; shift 2
  log "$name: $*"
  NCCL_PROFILER_PLUGIN="$plugin" NCCLSCOPE_JOB_ID="rfc-$name" limited "$s" "$@" \
    > "$out/$name.driver" 2> "$out/$name.err" < /dev/null
  log "$name rc=$? $(tail -n 1 "$out/$name.driver")"
}

cost() {
  : > "$out/cost.txt"
  for rep in 1 2 3; do
    for bytes in 8 1048576 16777216; do
      for cfg in none device host kernelch; do
        env=(NCCLSCOPE_JOB_ID=rfc-cost)
        case $cfg in
          device) env+=(NCCL_PROFILER_PLUGIN="$plugin" NCCLSCOPE_RING_MEMORY=device) ;;
          host) env+=(NCCL_PROFILER_PLUGIN="$plugin" NCCLSCOPE_RING_MEMORY=host) ;;
          kernelch) env+=(NCCL_PROFILER_PLUGIN="$plugin" NCCL_RFC_DEVHOOK_DISABLE=1) ;;
        esac
        line="$(env "${env[@]}" TEARDOWN_S=3 timeout -s KILL "${COST_LIMIT:-20}" "$work/driver" cost 200 "$bytes" 20 2>>"$out/cost.err" < /dev/null)"
        rc=$?
        echo "$cfg $bytes $rep $line" >> "$out/cost.txt"
        # A teardown that hung (rc 9) still measured; no figure at all stops the cost runs.
        [[ $line == *us_per_op=* ]] || { log "cost $cfg $bytes: rc=$rc, no figure, stopping the cost runs"; return; }
      done
    done
    log "cost repeat $rep done"
  done
}

# raw NAME COMMAND...: one 2-process PyTorch job without the daemon: segment-dump saves both processes'
# segments (raw/*.seg.xz, test data for the CPU tests, see tests/data/README.md) and prints their records.
raw() {
  local name=$1; shift
  mkdir -p "$out/raw"
  limited $(( ${TORCH_LIMIT:-60} + 10 )) "$bin/segment-dump" "$work/dump.sock" 2 "$out/raw" \
    > "$out/$name.dump" 2>&1 < /dev/null &
  local dump=$!
  for _ in $(seq 50); do [ -S "$work/dump.sock" ] && break; sleep 0.1; done
  NCCLSCOPE_SOCKET="$work/dump.sock" LD_PRELOAD="$work/nccl/libnccl.so.2" traced "$name" \
    "${TORCH_LIMIT:-60}" "$@"
  wait "$dump"
  log "$name: $(tr '\n' ' ' < "$out/$name.dump")"
  "$bin/segment-dump" --read "$out"/raw/"rfc-$name".*.seg > "$out/$name.records.txt" 2>&1
  xz -T0 "$out"/raw/"rfc-$name".*.seg
}

status=0
for c in "${cases[@]}"; do
  case $c in
    eager) traced eager 30 "$work/driver" eager 1000 ;;
    graph6) traced graph6 "${GRAPH_LIMIT:-30}" "$work/driver" graph 50 6 1 4 ;;
    burst*) traced "$c" "${GRAPH_LIMIT:-40}" "$work/driver" graph 50 "${c#burst}" 0 0 ;;
    cost) cost ;;
    torch) LD_PRELOAD="$work/nccl/libnccl.so.2" traced torch "${TORCH_LIMIT:-60}" python3 "$here/torch_graphs.py" 30 20 ;;
    torchraw) raw torchraw python3 "$here/torch_graphs.py" 30 20 ;;
    a2a|pp) LD_PRELOAD="$work/nccl/libnccl.so.2" traced "$c" "${TORCH_LIMIT:-60}" python3 "$here/torch_p2p.py" "$c" 9 10 ;;
    raw-a2a|raw-pp) raw "$c" python3 "$here/torch_p2p.py" "${c#raw-}" 9 10 ;;
    profile|profile0) LD_PRELOAD="$work/nccl/libnccl.so.2" traced "$c" "${TORCH_LIMIT:-60}" \
      python3 "$here/torch_profile.py" "$out/$c" 5 "$([ $c = profile ] && echo 7 || echo 0)" ;;
    *) log "unknown case $c"; status=1 ;;
  esac
done
log "settling"
settle
metrics > "$out/metrics.txt"
limited 10 "$bin/ncclscope" stats --api-socket "$work/api.sock" > "$out/stats.txt" 2>&1
# Each profiled rank's trace merged as a user would (--align correct, the default): the alignment
# the merge measured is in the merged trace (ncclscope_alignment) and its stderr.
for c in "${cases[@]}"; do
  [[ $c == profile* ]] || continue
  for r in 0 1; do
    limited 30 "$bin/ncclscope" export --api-socket "$work/api.sock" --job "rfc-$c" --rank "$r" \
      --merge "$out/$c/rank$r.pt.trace.json" -o "$out/$c/rank$r.merged.json" > "$out/$c/rank$r.align" 2>&1
    log "$c rank $r merge rc=$? $(tail -n 2 "$out/$c/rank$r.align" | tr '\n' ' ')"
  done
done
log "checking"
python3 "$here/check.py" "$out" "${cases[@]}" | tee "$out/check.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
exit $status
