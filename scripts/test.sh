#!/usr/bin/env bash
# The test command (README, .ci/run): installs what the tests need, builds everything, runs every test.
# Works on a fresh machine with only the Rust toolchain, Python 3 and a C compiler with make (AFL++);
# on one without tmux, as root with apt (Debian).
set -euo pipefail
cd "$(dirname "$0")/.."

# `top` is tested in a real terminal: tmux (CI runs this as root on Debian).
command -v tmux >/dev/null || { apt-get update -qq && apt-get install -y -qq tmux; }

# nvcc 13.0 from PyPI, so the CUDA hook is compiled and device-linked on every change.
source scripts/install-nvcc.sh

# Perfetto's own trace schema (its Python package), which reads the protobuf traces `export` writes in
# tests/tests/tools_daemon.rs.
if [ ! -x .venv-perfetto/bin/python ]; then
    python3 -m venv .venv-perfetto
    .venv-perfetto/bin/pip install -q perfetto==0.59.1 protobuf==7.36.2
fi

cargo build --workspace --all-targets
cargo test --workspace --no-fail-fast

# Coverage-guided fuzzing of the untrusted-input parsers, bounded (about a minute; FUZZ_SECONDS=0 skips).
if [ "${FUZZ_SECONDS:-12}" != 0 ]; then
    scripts/fuzz.sh
fi
