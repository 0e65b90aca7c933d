#!/usr/bin/env bash
# Builds the NCCL profiler plugin (release) and installs it as DIR/libnccl-profiler-ncclscope.so, the name
# NCCL derives from NCCL_PROFILER_PLUGIN=ncclscope. DIR defaults to /usr/local/lib.
#   scripts/install-plugin.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-/usr/local/lib}"
target="${CARGO_TARGET_DIR:-target}"
cargo build --release -p ncclscope-plugin
install -d "$dir"
install -m 0755 "$target/release/libnccl_profiler_ncclscope.so" "$dir/libnccl-profiler-ncclscope.so"
echo "installed $dir/libnccl-profiler-ncclscope.so"
echo "use: NCCL_PROFILER_PLUGIN=ncclscope (with $dir on the loader path) or NCCL_PROFILER_PLUGIN=$dir/libnccl-profiler-ncclscope.so"
