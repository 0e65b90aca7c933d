#!/usr/bin/env bash
# CUDA-graph replays on a lagging (fake) GPU through the real plugin and the real daemon, at a chosen
# replay count, checked op by op: 2 RFC fake ranks (`fakenccl-rank --gpu-lag`), a daemon with a spool,
# then `ncclscope export --format otlp-json` from the spool and graph_lag_check.py comparing every
# delivered instance's exec time with what the rank produced, and listing the daemon's loss counters.
#   BIN=<dir with ncclscope, fakenccl-rank, libnccl_profiler_ncclscope.so, libfakenccl_nccl_rfc.so> \
#     REPLAYS=100 bash tests/gpu/graph_lag_run.sh
# Runs on any Linux machine (no GPU used: host-memory rings); the release binaries on a quiet many-core host give the
# figures in docs/benchmarks.md. Writes to $OUT (or a temporary directory).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="$(readlink -f "${BIN:?directory with ncclscope, fakenccl-rank and the plugin .so}")"
replays=${REPLAYS:-100}
out="${OUT:-$(mktemp -d)}/graph-lag-$replays"
mkdir -p "$out/state" "$out/spool"
port=$((20000 + $$ % 20000))
cat >"$out/ncclscope.toml" <<TOML
socket = "$out/ncclscope.sock"
api_socket = "$out/api.sock"
state_dir = "$out/state"
[otlp]
endpoint = ""
[spool]
dir = "$out/spool"
[prometheus]
listen = "127.0.0.1:$port"
job_series = true
TOML
NCCLSCOPE_LOG=warn "$bin/ncclscope" daemon --config "$out/ncclscope.toml" 2>"$out/daemon.log" &
daemon=$!
trap 'kill $daemon 2>/dev/null || true' EXIT
sleep 1
pids=()
for rank in 0 1; do
    NCCLSCOPE_RING_MEMORY=cpu NCCLSCOPE_SOCKET="$out/ncclscope.sock" NCCLSCOPE_JOB_ID=graph-lag \
        "$bin/fakenccl-rank" --plugin "$bin/libnccl_profiler_ncclscope.so" --kind rfc --colls 4 --channels 4 \
        --graph-ops 50 --graph-channels 8 --replays "$replays" --eager-between 2 --gpu-lag \
        --kernel-ns 20000 --interval-us 100 --rank $rank --nranks 2 \
        >"$out/rank$rank.json" 2>"$out/rank$rank.log" &
    pids+=($!)
done
wait "${pids[@]}"
# Until the daemon has dropped both segments (everything drained and delivered), at most 60 s.
for _ in $(seq 600); do
    curl -s "127.0.0.1:$port/metrics" | grep -qx 'ncclscope_segments 0' && break
    sleep 0.1
done
sleep 1.5  # the Prometheus text is refreshed every second
curl -s "127.0.0.1:$port/metrics" >"$out/metrics.txt" || true
kill -TERM $daemon; wait $daemon || true
"$bin/ncclscope" export --spool "$out/spool" --job graph-lag --uid "$(id -u)" --format otlp-json \
    --output "$out/export.jsonl"
python3 "$here/graph_lag_check.py" "$out/rank0.json" "$out/rank1.json" "$out/export.jsonl" "$out/metrics.txt"
