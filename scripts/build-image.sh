#!/usr/bin/env bash
# Builds the daemon's container image from the Debian package: ncclscope:<version> (IMAGE names another).
#   scripts/build-image.sh            (CONTAINER_TOOL=podman for podman or buildah; default docker)
set -euo pipefail
cd "$(dirname "$0")/.."
deb=$(scripts/build-deb.sh | tail -1)
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -1)
"${CONTAINER_TOOL:-docker}" build -f deploy/container/Containerfile --build-arg "DEB=$(basename "$deb")" \
    -t "${IMAGE:-ncclscope:$version}" "$(dirname "$deb")"
