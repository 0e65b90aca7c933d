#!/usr/bin/env bash
# The test command (README, .ci/run): installs what the tests need, builds everything, runs every test.
# Works on a fresh machine with only the Rust toolchain, Python 3 and a C compiler with make (AFL++);
# what else they need comes from Debian's packages (CI runs this as root) and PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."

# nvcc 13.0 from PyPI, so the CUDA hook is compiled and device-linked on every change.
source scripts/install-nvcc.sh

# The package tests install the .deb with dpkg into a scratch root and check its units with
# systemd-analyze; podman and debootstrap build and run the image (scripts/install-podman.sh); the log
# tests use unshare (util-linux); nm (binutils) reads the binaries; `top` is tested in a real terminal
# (tmux).
need=()
command -v tmux >/dev/null || need+=(tmux)
command -v dpkg-deb >/dev/null || need+=(dpkg)
command -v systemd-analyze >/dev/null || need+=(systemd)
command -v unshare >/dev/null || need+=(util-linux)
command -v nm >/dev/null || need+=(binutils)
if [ ${#need[@]} -gt 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

# The Kubernetes manifests' schema checker (tests/tests/k8s.rs).
scripts/install-k8s-validate.sh

# Debian's Prometheus and promtool, extracted into .prometheus/ (tests/tests/prometheus_real.rs: the
# shipped configs, rules and dashboard queries against a real Prometheus scraping a daemon).
scripts/install-prometheus.sh

# Perfetto's own trace schema (its Python package), which reads the protobuf traces `export` writes in
# tests/tests/tools_daemon.rs.
if [ ! -x .venv-perfetto/bin/python ]; then
    python3 -m venv .venv-perfetto
    .venv-perfetto/bin/pip install -q perfetto==0.59.1 protobuf==7.36.2
fi

cargo build --workspace --all-targets
# The .deb the package tests install (target/deb/): a release build of the daemon and the plugin.
scripts/build-deb.sh
# The daemon's image from that .deb, built by podman on a base made with debootstrap (no image registry
# is reached here), for the image test in tests/tests/containers.rs. A machine whose kernel will not
# let podman run a container still builds the image (chroot isolation); only the test is skipped.
source scripts/install-podman.sh
image=$(CONTAINER_TOOL=podman BASE=debootstrap IMAGE=localhost/ncclscope:test scripts/build-image.sh)
if podman run --rm "$image" --version >/dev/null; then
    export NCCLSCOPE_TEST_IMAGE="$image"
else
    echo "test.sh: podman cannot run containers on this machine: the image test is skipped" >&2
fi
cargo test --workspace --no-fail-fast

# Coverage-guided fuzzing of the untrusted-input parsers, bounded (about a minute; FUZZ_SECONDS=0 skips).
if [ "${FUZZ_SECONDS:-12}" != 0 ]; then
    scripts/fuzz.sh
fi
