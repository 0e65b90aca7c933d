#!/usr/bin/env bash
# Bounded coverage-guided fuzzing (AFL++ through cargo-afl, stable Rust) of ncclscope's untrusted inputs:
# segment records (alone, and streams of them through the daemon's assembler), spool files, the
# registration (request and sealed memory file), the daemon configuration (fuzz/src/lib.rs).
# FUZZ_SECONDS per target (default 12; 5 targets, about a minute). Installs cargo-afl from crates.io
# and builds AFL++ once. Fails on a crash or hang; the failing inputs are left in
# target/afl/out/TARGET/default/{crashes,hangs}: fix the cause, then copy them to fuzz/regressions/TARGET/
# so that `cargo test` keeps checking them.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${FUZZ_SECONDS:-12}
targets=${FUZZ_TARGETS:-"record records spool register config"}

if ! cargo afl --version >/dev/null 2>&1; then
    cargo install cargo-afl --locked --version 0.18.2
fi
# Builds AFL++ (afl-fuzz and its runtime) from the sources cargo-afl ships, once per machine.
if ! { cargo afl fuzz -h 2>&1 || true; } | grep -q afl-fuzz; then
    cargo afl config --build --force
fi

# Instrumented builds go to their own target dir: the flags differ from the normal build's.
# Without debug info: the instrumented build compiles the daemon's whole dependency tree. Without the
# CUDA device code too: the plugin is only a build-order dependency of the daemon here.
export CARGO_TARGET_DIR=target/afl CARGO_PROFILE_DEV_DEBUG=0
unset NVCC
cargo afl build -p ncclscope-fuzz --features afl --bin ncclscope-fuzz
bin=target/afl/debug/ncclscope-fuzz

# No UI; CI machines have neither a performance governor to set nor core dumps to forward.
export AFL_NO_UI=1 AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 AFL_QUIET=1
# The spool and config targets write files (and the spool fsyncs them): on tmpfs that costs nothing.
export TMPDIR=/dev/shm
failed=0
for t in $targets; do
    seeds=target/afl/seeds/$t out=target/afl/out/$t
    rm -rf "$seeds" "$out"
    mkdir -p target/afl/out
    "$bin" --seeds "$t" "$seeds"
    cargo afl fuzz -V "$seconds" -i "$seeds" -o "$out" -- "$bin" "$t" >"$out.log" 2>&1 || {
        echo "fuzz $t: afl-fuzz failed:"; tail -20 "$out.log"; failed=1; continue;
    }
    stats=$out/default/fuzzer_stats
    execs=$(awk -F: '/^execs_done/ {gsub(/ /, "", $2); print $2}' "$stats")
    paths=$(awk -F: '/^corpus_count/ {gsub(/ /, "", $2); print $2}' "$stats")
    crashes=$(find "$out/default/crashes" "$out/default/hangs" -type f ! -name README.txt | wc -l)
    echo "fuzz $t: ${seconds}s, $execs executions, $paths inputs in the corpus, $crashes crashes or hangs"
    if [ "$crashes" -gt 0 ]; then
        find "$out/default/crashes" "$out/default/hangs" -type f ! -name README.txt
        failed=1
    fi
done
exit $failed
