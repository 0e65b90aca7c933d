#!/usr/bin/env bash
# Installs Debian's Prometheus (the `prometheus` package: prometheus and promtool) into
# <repo>/.prometheus, once, by extracting the package rather than installing it, so no service is
# started and no root is needed past the download. tests/tests/prometheus_real.rs runs that
# Prometheus against a daemon, and promtool checks and unit-tests the shipped configuration and
# recording rules (deploy/prometheus/, deploy/stack/).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.prometheus"
if [ -x "$root/usr/bin/prometheus" ] && [ -x "$root/usr/bin/promtool" ]; then
    exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
if ! apt-get download prometheus >/dev/null 2>&1; then
    apt-get update -qq
    apt-get download prometheus >/dev/null
fi
rm -rf "$root"
mkdir -p "$root"
dpkg-deb -x prometheus_*.deb "$root"
"$root/usr/bin/promtool" --version | head -1
