#!/usr/bin/env bash
# Builds the daemon's container image from the Debian package: ncclscope:<version> (IMAGE names another).
#   scripts/build-image.sh
#   CONTAINER_TOOL=podman      podman or buildah instead of docker
#   BASE=registry/debian:tag   another base (default debian:bookworm-slim, as the Containerfile says)
#   BASE=debootstrap           the base made from Debian's archive with debootstrap (needs root), for a
#                              machine that reaches Debian's mirror but no image registry (CI); kept
#                              as localhost/ncclscope-base:bookworm for the next build
# Prints the image's name last.
set -euo pipefail
cd "$(dirname "$0")/.."
tool="${CONTAINER_TOOL:-docker}"
deb=$(scripts/build-deb.sh | tail -1)
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -1)
image="${IMAGE:-ncclscope:$version}"
base="${BASE:-debian:bookworm-slim}"
if [ "$base" = debootstrap ]; then
    base=localhost/ncclscope-base:bookworm
    if ! "$tool" image inspect "$base" >/dev/null 2>&1; then
        rootfs=$(mktemp -d)
        trap 'rm -rf "$rootfs"' EXIT
        debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian >&2
        tar -C "$rootfs" -c . | "$tool" import - "$base" >&2
    fi
fi
# The build's RUN reaches Debian's archive through the host's network (podman's own needs a bridge
# that a machine which is itself a container may not allow).
net=()
[ "$tool" = podman ] && net=(--network host --isolation chroot)
"$tool" build "${net[@]}" -f deploy/container/Containerfile --build-arg "BASE=$base" \
    --build-arg "DEB=$(basename "$deb")" -t "$image" "$(dirname "$deb")" >&2
echo "$image"
