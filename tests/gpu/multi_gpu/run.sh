#!/usr/bin/env bash
# Real NCCL collectives on several GPUs (issue: per-channel kernel timings end to end, and the overhead).
# For the GPU machine, which has no cargo: build here and carry a folder holding
#   libnccl_profiler_ncclscope.so ncclscope otlp-sink
#   (cargo build --release -p ncclscope-plugin -p ncclscope -p ncclscope-tests --bin otlp-sink)
#   bash tests/gpu/multi_gpu/run.sh CARRIED_DIR [REPEATS]
# 1. overhead: all-reduce 8 B .. 1 GiB, configurations interleaved REPEATS times (default 3): no plugin, plugin
#    with the daemon running, plugin with the daemon stopped; medians and overhead in overhead.txt.
# 2. verify: the plugin run's collectives, as the daemon exported them (Perfetto file through `ncclscope
#    export`, spans through a real OTLP receiver), hold every channel's KernelCh timing, share one trace per
#    collective across ranks, and give a busBW within 5% of the benchmark's.
# With one GPU it stops at once (exit 3): a one-rank all-reduce has no kernel to time.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="$(readlink -f "${1:?usage: run.sh CARRIED_DIR [REPEATS]}")"
repeats="${2:-3}"
out="${OUT:-$(mktemp -d)}"
work="$(mktemp -d)"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # multicast stays off
export NCCLSCOPE_SOCKET="$work/ncclscope.sock"
ngpu=$(nvidia-smi -L | wc -l)
ranks=$(( ngpu >= 2 ? 2 : 1 ))
echo "GPUs: $ngpu, ranks: $ranks"; nvidia-smi -L
if [ "$ranks" -lt 2 ]; then
  # NCCL 2.28 refuses two ranks on one GPU, and a one-rank all-reduce launches no kernel (PyTorch then
  # captures an empty graph): there is nothing to time or verify. Seen on the H200, 2026-12-02.
  echo "BLOCKED: needs 2 GPUs (found $ngpu)"; exit 3
fi

"$bin/otlp-sink" --seconds 3000 > "$out/spans.jsonl" 2> "$work/sink.err" &
sink=$!
for _ in $(seq 50); do [ -s "$out/spans.jsonl" ] && break; sleep 0.1; done
endpoint="$(head -n 1 "$out/spans.jsonl" | cut -d' ' -f2)"
daemon=""
start_daemon() {
  "$bin/ncclscope" daemon --socket "$NCCLSCOPE_SOCKET" --api-socket "$work/api.sock" \
    --state-dir "$work/state" --spool-dir "$work/spool" --otlp-endpoint "$endpoint" --prometheus-listen "" \
    2>> "$out/daemon.log" &
  daemon=$!
  for _ in $(seq 100); do [ -S "$work/api.sock" ] && return; sleep 0.1; done
  echo "daemon did not start"; tail "$out/daemon.log"; exit 1
}
stop_daemon() { [ -n "$daemon" ] && kill "$daemon" && wait "$daemon"; daemon=""; rm -f "$work/api.sock"; }
trap 'stop_daemon; kill $sink 2>/dev/null' EXIT

port=29511
for rep in $(seq "$repeats"); do
  for cfg in none plugin nodaemon; do
    port=$((port + 1))
    case $cfg in
      none) unset NCCL_PROFILER_PLUGIN ;;
      plugin) export NCCL_PROFILER_PLUGIN="$bin/libnccl_profiler_ncclscope.so"; start_daemon ;;
      nodaemon) export NCCL_PROFILER_PLUGIN="$bin/libnccl_profiler_ncclscope.so" ;;
    esac
    export NCCLSCOPE_JOB_ID="gpu-$cfg-$rep"
    echo "== $cfg, repeat $rep"
    python3 "$here/allreduce.py" --ranks "$ranks" --port $port --out "$out/bench.$cfg.$rep.jsonl" || exit 1
    if [ "$cfg" = plugin ]; then
      sleep 3   # the daemon's drain and export intervals
      "$bin/ncclscope" stats --api-socket "$work/api.sock" --job "$NCCLSCOPE_JOB_ID" > "$out/stats.$rep.txt"
      "$bin/ncclscope" export --api-socket "$work/api.sock" --job "$NCCLSCOPE_JOB_ID" -o "$out/trace.$rep.json"
      stop_daemon
    fi
  done
done
python3 "$here/check.py" overhead "$out" | tee "$out/overhead.txt"
cat "$out/stats.1.txt"
python3 "$here/check.py" verify "$out/trace.1.json" "$out/spans.jsonl" "$out/bench.plugin.1.jsonl" "$ranks" | tee "$out/verify.txt"
exit "${PIPESTATUS[0]}"
