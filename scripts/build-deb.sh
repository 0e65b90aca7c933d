#!/usr/bin/env bash
# Builds the Debian package of ncclscope from this workspace: the daemon without its demo (no fake NCCL
# host or stand-in libnccl linked), the plugin where NCCL_PROFILER_PLUGIN=ncclscope finds it, the
# systemd units, the sysusers.d entry, the configuration (conffiles), the dashboards and the Slurm
# TaskProlog and Epilog. dpkg-deb
# (in every Debian and Ubuntu) assembles it; the maintainer scripts are deploy/debian/.
#   scripts/build-deb.sh [OUTDIR]          (default target/deb; prints the .deb's path last)
# Note: target/release/ncclscope is then the packaged build; `cargo run --release -- demo` rebuilds it.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-target/deb}"
target="${CARGO_TARGET_DIR:-target}"

version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -1)
arch=$(dpkg --print-architecture)
case "$arch" in
    amd64) multiarch=x86_64-linux-gnu ;;
    arm64) multiarch=aarch64-linux-gnu ;;
    *) echo "build-deb.sh: no multiarch directory known for $arch" >&2; exit 1 ;;
esac

# nvcc, so the plugin carries the device hook (without it the plugin would build and report the hook
# unavailable).
source scripts/install-nvcc.sh >&2
cargo build --release --locked -p ncclscope --no-default-features --bin ncclscope
cargo build --release --locked -p ncclscope-plugin --lib

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
install -D -m 0755 "$target/release/ncclscope" "$stage/usr/bin/ncclscope"
# Line tables out (a quarter of the size), symbols kept: backtraces name functions, and nm shows
# what is linked.
strip --strip-debug "$stage/usr/bin/ncclscope"
install -D -m 0644 "$target/release/libnccl_profiler_ncclscope.so" \
    "$stage/usr/lib/$multiarch/libnccl-profiler-ncclscope.so"
install -d "$stage/usr/lib/systemd/system"
sed 's|^ExecStart=/usr/local/bin/ncclscope |ExecStart=/usr/bin/ncclscope |' deploy/ncclscope.service \
    > "$stage/usr/lib/systemd/system/ncclscope.service"
grep -q '^ExecStart=/usr/bin/ncclscope ' "$stage/usr/lib/systemd/system/ncclscope.service"
install -m 0644 deploy/ncclscope.socket "$stage/usr/lib/systemd/system/"
install -D -m 0644 deploy/ncclscope.sysusers "$stage/usr/lib/sysusers.d/ncclscope.conf"
install -D -m 0644 deploy/ncclscope.toml "$stage/etc/ncclscope/ncclscope.toml"
install -D -m 0644 -t "$stage/usr/share/ncclscope" deploy/grafana-dashboard.json deploy/otel-collector.yaml
install -D -m 0644 -t "$stage/usr/share/ncclscope/prometheus" deploy/prometheus/ncclscope-rules.yaml \
    deploy/prometheus/prometheus-scrape.yml
# Slurm: TaskProlog and Epilog (deploy/slurm/), the plugin's path for this architecture.
install -d "$stage/usr/lib/ncclscope/slurm"
for f in task-prolog epilog; do
    sed "s|/usr/lib/x86_64-linux-gnu/|/usr/lib/$multiarch/|" "deploy/slurm/$f" > "$stage/usr/lib/ncclscope/slurm/$f"
    chmod 0755 "$stage/usr/lib/ncclscope/slurm/$f"
done
sed "s|/usr/lib/x86_64-linux-gnu/|/usr/lib/$multiarch/|" deploy/slurm/slurm.env > "$stage/etc/ncclscope/slurm.env"
chmod 0644 "$stage/etc/ncclscope/slurm.env"
install -d "$stage/usr/share/ncclscope/enroot"
sed "s|/usr/lib/x86_64-linux-gnu/|/usr/lib/$multiarch/|g" deploy/slurm/enroot-ncclscope.fstab \
    > "$stage/usr/share/ncclscope/enroot/ncclscope.fstab"
chmod 0644 "$stage/usr/share/ncclscope/enroot/ncclscope.fstab"
install -D -m 0644 README.md "$stage/usr/share/doc/ncclscope/README.md"
# The operator's pages the README links to, at the same relative paths.
install -D -m 0644 -t "$stage/usr/share/doc/ncclscope/docs" docs/operator-guide.md \
    docs/troubleshooting.md docs/configuration.md docs/metrics.md docs/how-it-works.md
printf 'ncclscope\nLicense: %s\n' "$(sed -n 's/^license = "\(.*\)"$/\1/p' Cargo.toml | head -1)" \
    > "$stage/usr/share/doc/ncclscope/copyright"

install -d "$stage/DEBIAN"
install -m 0755 deploy/debian/postinst deploy/debian/prerm deploy/debian/postrm "$stage/DEBIAN/"
install -m 0644 deploy/debian/triggers "$stage/DEBIAN/"
printf '%s\n' /etc/ncclscope/ncclscope.toml /etc/ncclscope/slurm.env > "$stage/DEBIAN/conffiles"
cat > "$stage/DEBIAN/control" <<EOF
Package: ncclscope
Version: $version
Architecture: $arch
Maintainer: ncclscope developers <ncclscope@users.noreply.github.com>
Installed-Size: $(du -sk --exclude=DEBIAN "$stage" | cut -f1)
Depends: libc6 (>= 2.34)
Recommends: systemd
Section: admin
Priority: optional
Homepage: https://github.com/ncclscope/ncclscope
Description: NCCL kernel telemetry for GPU clusters
 The ncclscope node daemon (systemd socket-activated, its own system user) and the NCCL profiler
 plugin (NCCL_PROFILER_PLUGIN=ncclscope): per-collective, per-rank and per-channel kernel timings
 on the GPU's clock, exported over OTLP and Prometheus, with the operator tools ncclscope top, stats
 and export.
EOF

mkdir -p "$out"
deb="$out/ncclscope_${version}_${arch}.deb"
dpkg-deb --root-owner-group -Zxz --build "$stage" "$deb" >/dev/null
echo "$deb"
